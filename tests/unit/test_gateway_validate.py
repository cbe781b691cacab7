"""Request validation and the relay's pure parts (usage in SSE, error bodies): table tests."""

import msgspec
import pytest

from hpcserve.gateway import validate
from hpcserve.gateway.errors import APIError
from hpcserve.gateway.relay import _events_with_usage, _report_latest, openai_error_body

CHAT = "/v1/chat/completions"
MSG = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "needle"),
    [
        (CHAT, b"{", None, "not valid JSON"),
        (CHAT, b"[]", None, "not a JSON object"),
        (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}', None, "UTF-8"),
        (CHAT, b'{"model": "m", "x": "\xc3"}', None, "not valid UTF-8"),
        (CHAT, b'{"messages": []}', "messages", "length >= 1"),
        (CHAT, b'{"model": "m"}', "messages", "'messages' is required"),
        (CHAT, f'{{"model": "m", {MSG}, "max_tokens": -5}}'.encode(), "max_tokens", "got -5"),
        (CHAT, f'{{"model": "m", {MSG}, "n": 1000}}'.encode(), "n", "<= 128"),
        (CHAT, f'{{"model": "m", {MSG}, "n": "2"}}'.encode(), "n", "expected int, got str"),
        (CHAT, f'{{"model": "m", {MSG}, "temperature": 9}}'.encode(), "temperature", "<= 2"),
        (CHAT, f'{{"model": "m", {MSG}, "stop": 3}}'.encode(), "stop", "expected"),
        (CHAT, f'{{"model": "m", {MSG}, "top_logprobs": 99}}'.encode(), "top_logprobs", "<= 20"),
        (
            CHAT,
            f'{{"model": "m", {MSG}, "response_format": {{"type": "yaml"}}}}'.encode(),
            "response_format.type",
            "invalid enum value 'yaml'",
        ),
        (
            CHAT,
            f'{{"model": "m", {MSG}, "response_format": {{"type": "json_schema", '
            f'"json_schema": {{"name": "x", "schema": {{"type": "objekt"}}}}}}}}'.encode(),
            "response_format.json_schema.schema",
            "not a valid JSON Schema at type",
        ),
        (
            CHAT,
            f'{{"model": "m", {MSG}, "response_format": {{"type": "json_schema"}}}}'.encode(),
            "response_format.json_schema.schema",
            "is required",
        ),
        ("/v1/completions", b'{"model": "m", "prompt": ""}', "prompt", "must not be empty"),
        ("/v1/completions", b'{"model": "m", "prompt": ["a", 1]}', "prompt", "not a mix"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "logprobs": 50}', "logprobs", "<= 20"),
        ("/v1/embeddings", b'{"model": "m", "input": "x", "stream": true}', "stream", "not stream"),
        ("/v1/embeddings", b'{"model": "m", "input": {}}', "input", "expected"),
        ("/v1/rerank", b'{"model": "m", "query": "q"}', "documents", "'documents' is required"),
        ("/v1/score", b'{"model": "m", "text_1": "a", "text_2": 3}', "text_2", "expected"),
    ],
)
def test_bad_bodies_name_the_problem(
    endpoint: str, body: bytes, param: str | None, needle: str
) -> None:
    with pytest.raises(APIError) as err:
        validate.parse(endpoint, body)
    assert err.value.status == 400
    assert needle in err.value.message and err.value.param == param


def test_good_bodies_keep_unknown_fields_for_the_engine() -> None:
    body = f'{{"model": "m", {MSG}, "n": 2, "seed": 1, "stop": ["x"], "logprobs": true, '
    body += '"top_logprobs": 2, "max_completion_tokens": 4, "guided_choice": ["a"], '
    body += '"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
    body += '"schema": {"type": "object"}}}}'
    request = validate.parse(CHAT, body.encode())
    assert isinstance(request, validate.ChatRequest)
    assert (request.n, request.seed, request.max_completion_tokens) == (2, 1, 4)


class Seen:
    def __init__(self) -> None:
        self.usage: tuple[int, int] | None = None

    def usage_of(self, prompt: int, completion: int) -> None:
        self.usage = (prompt, completion)


@pytest.mark.parametrize("strip", [True, False])
def test_the_usage_event_is_read_and_dropped_only_when_asked(strip: bool) -> None:
    seen = Seen()
    exchange = type("E", (), {"usage": lambda self, p, c: seen.usage_of(p, c)})()
    chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "\\"usage\\": x"}}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n'
    done = b"data: [DONE]\n\n"
    out = _events_with_usage(chunk + usage + done, exchange, strip)  # type: ignore[arg-type]
    assert seen.usage == (3, 4)
    assert out == (chunk + done if strip else chunk + usage + done)


@pytest.mark.parametrize(
    "usage",
    [
        b',"usage":{"prompt_tokens":3,"total_tokens":%d,"completion_tokens":%d}}',  # vLLM's
        b', "usage": {"prompt_tokens": 3, "total_tokens": %d, "completion_tokens": %d}}',
    ],
)
@pytest.mark.parametrize("strip_continuous", [True, False])
def test_continuous_usage_is_kept_for_the_end_and_cut_out_when_not_asked(
    usage: bytes, strip_continuous: bool
) -> None:
    seen = Seen()
    exchange = type("E", (), {"usage": lambda self, p, c: seen.usage_of(p, c)})()
    event = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"tok"}}]'
    block = b"".join(event + usage % (3 + n, n) + b"\n\n" for n in (1, 2))
    latest: list[bytes] = []
    out = _events_with_usage(block, exchange, True, strip_continuous, latest)  # type: ignore[arg-type]
    events = [msgspec.json.decode(e[6:]) for e in out.split(b"\n\n") if e]
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["tok", "tok"]
    assert all(("usage" in e) is not strip_continuous for e in events)
    assert seen.usage is None  # not decoded per event
    _report_latest(exchange, latest)  # type: ignore[arg-type]  # the stream ended early
    assert seen.usage == (3, 2)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b'{"error": {"message": "as is", "type": "x", "param": null, "code": 400}}', "as is"),
        (b'{"object": "error", "message": "flat", "type": "BadRequestError", "code": 400}', "flat"),
        (b"Not Found", "The engine answered 404: Not Found"),
        (b"", "The engine refused this request (HTTP 404) and gave no detail"),
    ],
)
def test_engine_errors_come_back_in_openai_shape(payload: bytes, message: str) -> None:
    error = msgspec.json.decode(openai_error_body(404, payload))["error"]
    assert error["message"] == message and {"type", "param", "code"} <= set(error)


def test_overflow_without_an_external_api_is_refused_at_start() -> None:
    from hpcserve.config import ConfigError, parse_config

    tenants = [{"name": "t", "overflow": "external"}]
    with pytest.raises(ConfigError, match=r"gateway\.overflow\.base_url: tenants t"):
        parse_config({"gateway": {"tenants": tenants}})
    overflow = {"base_url": "http://x/v1", "models": {"a": "b"}}
    assert parse_config({"gateway": {"tenants": tenants, "overflow": overflow}})
