"""What an engine is sent for a client's body (gateway/app.py `_dispatch`): the tenant's
cache_salt and, for a stream, the usage options the gateway needs, appended to the client's
bytes (contracts/json_members.py) or set in a decoded body where the client wrote the key
itself; each key once, everything else as the client sent it. Through the real gateway
app and router; the engine is a small HTTP server on loopback that records the bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.contracts.cache_salt import tenant_salt
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.app import Gateway, build_app
from tests.engine_stub import EVENT_STREAM, JSON, USAGE, StubEngine, chat_answer, chat_stream
from tests.routers import loopback_router_config, running_router

KEY = "sk-body"


class Engine(StubEngine):
    """Answers a chat completion, streamed when asked (with the usage so far on each event
    when asked for continuous usage)."""

    def answer(self, body: bytes) -> tuple[int, str, bytes]:
        request = json.loads(body)
        if not request.get("stream"):
            return 200, JSON, chat_answer("ab", "stop")
        options = request.get("stream_options") or {}
        running = {"usage": USAGE} if options.get("continuous_usage_stats") else {}
        events = [{"choices": [{"index": 0, "delta": {"content": "ab"}}], **running}]
        if options.get("include_usage"):
            events.append({"choices": [], "usage": USAGE})
        return 200, EVENT_STREAM, chat_stream(events)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, Engine]]:
    engine = Engine()
    with running_router(loopback_router_config(lease_s=600.0)) as router:
        agent = RegistryAgent(router.config.registry_bind, p.Register("r", "m", engine.url))
        agent.register()
        agent.process_replies(30.0)
        assert agent.registered
        gateway = Gateway(
            GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))]),
            routing_endpoint=router.config.routing_bind,
            configured_models={"m"},
        )
        try:
            with TestClient(build_app(gateway)) as client:
                yield client, engine
        finally:
            agent.close()
            engine.close()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key twice: {keys}"
    return dict(pairs)


CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi \\"}\\" {"}]'
BOTH = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize(
    ("body", "salt_of", "options", "usage_to_client"),
    [
        (CHAT + b"}", "", None, False),
        (CHAT + b' ,"max_tokens": 5 }\n', "", None, False),
        (CHAT + b', "stream": true}', "", BOTH, False),
        (CHAT + b', "stream": true}  \r\n', "", BOTH, False),
        (CHAT + b', "stream": true, "stream_options": {"include_usage": true}}', "", BOTH, True),
        (CHAT + b', "stream": true, "stream_options": {"include_usage": false}}', "", BOTH, False),
        (CHAT + b', "stream_options": {"include_usage": true, "continuous_usage_stats": true},'
         b' "stream": true}', "", BOTH, True),
        (CHAT + b', "cache_salt": "mine"}', "mine", None, False),
        (CHAT + b', "cache_salt": "mine", "stream": true}', "mine", BOTH, False),
    ],
)  # fmt: skip
def test_the_engine_gets_the_clients_body_with_the_gateways_keys(
    served: tuple[TestClient, Engine],
    body: bytes,
    salt_of: str,
    options: dict[str, bool] | None,
    usage_to_client: bool,
) -> None:
    client, engine = served
    reply = client.post(
        "/v1/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert reply.status_code == 200, reply.text
    sent = json.loads(engine.raw[-1], object_pairs_hook=_unique_keys)
    expected = json.loads(body)
    expected["cache_salt"] = tenant_salt("t", salt_of)
    if options is not None:
        expected["stream_options"] = options
    assert sent == expected
    if expected.get("stream"):
        assert ('"usage"' in reply.text) is usage_to_client
