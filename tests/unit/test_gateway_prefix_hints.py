"""Prefix hints for the router: long prompts are tokenized off the event loop, same hints."""

from __future__ import annotations

import asyncio
import json

import pytest

from hpcserve.config import GatewayConfig
from hpcserve.contracts import protocol as p
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints
from hpcserve.gateway import app as gateway_app
from hpcserve.tinymodels import make_tiny_model


@pytest.fixture(scope="module")
def hints(tmp_path_factory: pytest.TempPathFactory) -> RouteHints:
    hints = RouteHints()
    model_dir = make_tiny_model("chat", tmp_path_factory.mktemp("m") / "chat")
    hints.add_model("m", PromptTokenizer.from_dir(model_dir), 16)
    return hints


def body_of(chars: int) -> bytes:
    text = ("consignee ACME GmbH " * (chars // 20 + 1))[:chars]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def test_long_prompts_are_tokenized_on_the_pool_with_the_same_hints(hints: RouteHints) -> None:
    gateway = gateway_app.Gateway(
        GatewayConfig(), routing_endpoint="tcp://127.0.0.1:9", configured_models={"m"}
    )
    gateway.route_hints = hints
    short, long = body_of(100), body_of(3 * gateway_app.INLINE_HINT_BYTES)
    headers = {"x-session-id": "s1"}

    async def run() -> list[dict[str, object]]:
        return [
            await gateway.prefix_hints("m", short, headers),
            await gateway.prefix_hints("m", long, headers),
            await gateway.prefix_hints("other", long, headers),
        ]

    on_loop, pooled, uncovered = asyncio.run(run())
    assert gateway._hint_pool is not None, "the long body went to the thread pool"
    assert pooled == hints.hints("m", json.loads(long), headers)
    assert on_loop == hints.hints("m", json.loads(short), headers)
    assert pooled["block_hashes"] and pooled["session_key"] == "s1"
    assert uncovered == {"session_key": "s1"}
    # With the pool's queue full, a prompt the cache does not hold is routed without prefix
    # hints, not delayed; one it holds still gets them (no tokenizing left to wait for).
    gateway._hints_waiting = gateway_app.MAX_HINTS_WAITING
    fresh = body_of(3 * gateway_app.INLINE_HINT_BYTES + 40)
    assert asyncio.run(gateway.prefix_hints("m", fresh, headers)) == {"session_key": "s1"}
    assert asyncio.run(gateway.prefix_hints("m", long, headers)) == pooled
    gateway._hint_pool.shutdown()


def test_an_alias_is_hashed_with_its_targets_tokenizer(hints: RouteHints) -> None:
    gateway = gateway_app.Gateway(
        GatewayConfig(), routing_endpoint="tcp://127.0.0.1:9", configured_models={"m"}
    )
    gateway.route_hints = hints
    replicas = [
        p.ReplicaInfo(
            rid, "m", f"http://{rid}", "pool", 0, "n1", 0.0, 0.0, 0, p.ReplicaLoad(), model_ref="m@1"
        )
        for rid in ("r1", "r2")  # with one, no hints: they could not change the decision
    ]
    gateway.routing.view.update(replicas, {"extraction": "m@1"})
    body = body_of(100)
    got = asyncio.run(gateway.prefix_hints("extraction", body, {}))
    assert got["block_hashes"] and got == hints.hints("m", json.loads(body), {})
