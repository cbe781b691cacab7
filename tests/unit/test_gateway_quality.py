"""Online quality per deployment (gateway/quality.py): what an answer said, whole or
streamed in chunks cut anywhere, and what the counters of its deployment make of it."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hpcserve.gateway import validate
from hpcserve.gateway.metrics import GatewayMetrics
from hpcserve.gateway.quality import DeploymentMetrics, OutputWatch, is_refusal, wants_json
from tests.unit.test_gateway_relay import SSE_HEAD, chunked, engine, fixed, forward


def chat(content: str, finish: str = "stop", **message: object) -> bytes:
    choice = {"index": 0, "finish_reason": finish, "message": {"content": content, **message}}
    return json.dumps({"choices": [choice], "usage": {"completion_tokens": 3}}).encode()


def stream(texts: list[str], finish: str, *, spaced: bool = False) -> bytes:
    """An SSE stream as vLLM writes it (compact), or as other servers do (spaced)."""
    seps = (", ", ": ") if spaced else (",", ":")
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in texts]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    body = b"".join(b"data: " + json.dumps(c, separators=seps).encode() + b"\n\n" for c in chunks)
    return body + b"data: [DONE]\n\n"


def watched(body: bytes, cut_every: int, structured: bool = False) -> OutputWatch:
    watch = OutputWatch(structured)
    for at in range(0, len(body), cut_every):
        watch.feed(body[at : at + cut_every])
    return watch


@pytest.mark.parametrize(
    ("body", "structured", "truncated", "valid", "refusal"),
    [
        (chat("Invoice 4711."), False, False, False, False),
        (chat('{"invoice": 4', "length"), True, True, False, False),
        (chat('{"invoice": 4711}'), True, False, True, False),
        (chat('{"note": "a\tb"}'), True, False, False, False),  # a raw tab: not strict JSON
        (chat("I'm sorry, but I can't help with that."), False, False, False, True),
        (chat("  I\u2019m sorry, but I cannot do that."), False, False, False, True),
        (chat("", refusal="no"), False, False, False, True),  # OpenAI's refusal field
        (chat("I can't stress enough how late this is."), False, False, False, False),
        (
            json.dumps(
                {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            ).encode(),
            False,
            True,
            False,
            False,
        ),
        (b"not json", False, False, False, False),
    ],
)
def test_a_whole_answer(body, structured, truncated, valid, refusal) -> None:
    watch = OutputWatch(structured)
    watch.whole(body)
    assert (watch.truncated, watch.valid_json(), watch.refusal()) == (truncated, valid, refusal)


@pytest.mark.parametrize("cut_every", [1, 7, 23, 10_000])
@pytest.mark.parametrize("spaced", [False, True])
def test_a_stream_cut_anywhere(cut_every: int, spaced: bool) -> None:
    truncated = stream(['{"invoice"', ": 47"], "length", spaced=spaced)
    watch = watched(truncated, cut_every, structured=True)
    assert watch.truncated and not watch.valid_json()
    whole = stream(['{"invoice"', ": 4711}"], "stop", spaced=spaced)
    watch = watched(whole, cut_every, structured=True)
    assert not watch.truncated and watch.valid_json()
    refused = stream(["I'm sorry, ", "but I cannot help with that."], "stop", spaced=spaced)
    assert watched(refused, cut_every).refusal()


def test_a_long_stream_is_decoded_only_until_its_opening_is_in() -> None:
    body = stream(["word " * 10] * 100, "length")
    watch = watched(body, 50)
    assert watch.truncated  # found by a byte search, after decoding stopped
    assert sum(map(len, watch.texts[0])) < 200  # only the opening was kept
    structured = watched(stream(["1"] * 300, "stop"), 50, structured=True)
    assert "".join(structured.texts[0]) == "1" * 300 and structured.valid_json()


def test_the_refusal_heuristic_reads_the_opening_only() -> None:
    assert is_refusal("I cannot assist with this request.")
    assert not is_refusal("Here is the summary. I cannot help noticing the date is wrong.")


def test_json_output_is_what_response_format_or_structured_outputs_ask_for() -> None:
    def parsed(**fields: object) -> validate.Request:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
        return validate.parse("/v1/chat/completions", json.dumps(body).encode())

    assert wants_json(parsed(response_format={"type": "json_object"}))
    assert wants_json(parsed(structured_outputs={"json": {"type": "object"}}))
    assert not wants_json(parsed(response_format={"type": "text"}))
    assert not wants_json(parsed())


def test_the_counters_of_a_deployment() -> None:
    registry = CollectorRegistry()
    deployment = DeploymentMetrics(GatewayMetrics(registry), "extraction", "docs@2", "")
    structured = OutputWatch(True)
    structured.whole(chat("{not json", "length"))
    deployment.answered(200, structured, 0.05)
    deployment.answered(500, OutputWatch(False), None)
    deployment.failed()
    text = generate_latest(registry).decode()
    labels = '{adapter="",model="extraction",version="docs@2"}'
    for name, value in (
        ("answers", 3),
        ("errors", 2),
        ("truncations", 1),
        ("structured", 1),
        ("structured_invalid", 1),
        ("refusals", 0),
    ):
        line = f"hpcserve_gateway_deployment_{name}_total{labels} {value:.1f}"
        if value:
            assert line in text, line
    assert f"hpcserve_gateway_deployment_ttft_seconds_count{labels} 1.0" in text


def test_the_relay_shows_a_stream_and_a_whole_answer_to_the_watch() -> None:
    body = stream(["I'm sorry, but I can't ", "do that"], "length")
    # The engine's chunks cut an event (and its finish_reason) in two.
    raw = SSE_HEAD + chunked(body[:101], body[101:-30], body[-30:])
    streamed, whole = OutputWatch(False), OutputWatch(True)
    answer = chat('{"invoice": 4711}')
    raw_whole = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(answer), answer)
    )

    async def run() -> tuple[list[object], list[object]]:
        async with engine(fixed(raw)) as url:
            _, relayed, seen = await forward(url, stream=True, watch=streamed)  # type: ignore[arg-type]
            assert relayed == body  # relayed as the engine sent it
        async with engine(fixed(raw_whole)) as url:
            _, _, seen_whole = await forward(url, watch=whole)  # type: ignore[arg-type]
        return seen, seen_whole

    seen, seen_whole = asyncio.run(run())
    assert streamed.truncated and streamed.refusal()
    assert whole.valid_json() and not whole.truncated
    assert ("done", 200) in seen and ("done", 200) in seen_whole


def test_the_fallback_view_names_the_version_as_the_router_does() -> None:
    from hpcserve.contracts import protocol as p
    from hpcserve.gateway.replica_view import ReplicaView

    def info(rid: str, model: str, ref: str) -> p.ReplicaInfo:
        return p.ReplicaInfo(
            rid, model, f"http://{rid}", "pool", 1, "n1", 1.0, 0.1, 0, p.ReplicaLoad(),
            model_ref=ref,
        )  # fmt: skip

    view = ReplicaView(300.0, clock=lambda: 0.0)
    view.update([info("a", "docs-v1", "docs@1"), info("b", "plain", "")], {"extraction": "docs@1"})
    view.router_lost("test")
    assert view.pick("extraction") == p.RouteReply(
        0, "a", "http://a", "", "docs-v1", model_ref="docs@1"
    )
    assert view.pick("docs-v1") == p.RouteReply(0, "a", "http://a", model_ref="docs@1")
    assert view.pick("plain") == p.RouteReply(0, "b", "http://b")
