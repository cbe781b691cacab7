"""What an engine is sent for a client's body (gateway/app.py `_dispatch`): the tenant's
cache_salt and, for a stream, the usage options the gateway needs, appended to the client's
bytes (contracts/json_members.py) or set in a decoded body where the client wrote the key
itself; each key once, everything else as the client sent it. Through the real gateway
app and router; the engine is a small HTTP server on loopback that records the bytes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.contracts.cache_salt import tenant_salt
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.app import Gateway, build_app
from tests.routers import loopback_router_config, running_router

KEY = "sk-body"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


class Engine:
    """Records each request body's bytes; answers a chat completion, streamed when asked
    (with the usage so far on each event when asked for continuous usage)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                engine.bodies.append(raw)
                body = json.loads(raw)
                if body.get("stream"):
                    options = body.get("stream_options") or {}
                    running = {"usage": USAGE} if options.get("continuous_usage_stats") else {}
                    events = [{"choices": [{"index": 0, "delta": {"content": "ab"}}], **running}]
                    if options.get("include_usage"):
                        events.append({"choices": [], "usage": USAGE})
                    data = b"".join(
                        b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                                 "created": 0, "model": "m", **e}).encode() + b"\n\n"
                        for e in events
                    ) + b"data: [DONE]\n\n"  # fmt: skip
                    kind = "text/event-stream"
                else:
                    data = json.dumps({
                        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "ab"}}],
                        "usage": USAGE,
                    }).encode()  # fmt: skip
                    kind = "application/json"
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
    sent = json.loads(engine.bodies[-1], object_pairs_hook=_unique_keys)
    expected = json.loads(body)
    expected["cache_salt"] = tenant_salt("t", salt_of)
    if options is not None:
        expected["stream_options"] = options
    assert sent == expected
    if expected.get("stream"):
        assert ('"usage"' in reply.text) is usage_to_client
