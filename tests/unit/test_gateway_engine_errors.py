"""What the client sees when the engine, or the gateway itself, fails: OpenAI's shape, a
request id, one log line and a counter; with a real router and an engine that answers as
vLLM 0.32.0 does on an input it cannot take (HTTP 500, empty message)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.gateway import validate
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.router.server import RouterServer

KEY = "sk-engine-errors"
HEADERS = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-17"}
BODY = {"model": "broken", "messages": [{"role": "user", "content": "hi"}]}
VLLM_500 = b'{"error":{"message":"","type":"InternalServerError","param":null,"code":500}}'


class _Broken(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(VLLM_500)))
        self.end_headers()
        self.wfile.write(VLLM_500)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def client(router: RouterServer) -> Iterator[tuple[TestClient, Gateway]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    router.registry.register(p.Register("broken-1", "broken", url), now=1e12)
    config = GatewayConfig(
        api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))],
        route_timeout_s=60.0,
        audit_log="",
    )
    gateway = Gateway(
        config, routing_endpoint=router.config.routing_bind, configured_models={"broken"}
    )
    try:
        with TestClient(build_app(gateway), raise_server_exceptions=False) as test_client:
            yield test_client, gateway
    finally:
        server.shutdown()
        server.server_close()


def test_an_engine_500_is_openai_shaped_logged_and_counted(
    client: tuple[TestClient, Gateway], caplog: pytest.LogCaptureFixture
) -> None:
    test_client, gateway = client
    with caplog.at_level(logging.WARNING, logger="hpcserve.gateway.app"):
        response = test_client.post("/v1/chat/completions", json=BODY, headers=HEADERS)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error == {
        "message": "The engine failed on this request (HTTP 500) and gave no detail "
        "(request id req-17)",
        "type": "server_error",
        "param": None,
        "code": "engine_error",
    }
    (line,) = [r for r in caplog.records if "engine error" in r.getMessage()]
    assert "request id req-17" in line.getMessage() and "broken-1" in line.getMessage()
    assert gateway.metrics.engine_errors.labels("broken", "500").value == 1


def test_an_unexpected_exception_is_one_log_line_and_an_openai_500(
    client: tuple[TestClient, Gateway],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    test_client, gateway = client

    def broken_parse(endpoint: str, body: bytes) -> validate.Request:
        raise RuntimeError("a bug")

    monkeypatch.setattr(validate, "parse", broken_parse)
    with caplog.at_level(logging.DEBUG, logger="hpcserve.gateway.app"):
        response = test_client.post("/v1/chat/completions", json=BODY, headers=HEADERS)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "req-17" in error["message"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "POST /v1/chat/completions failed (request id req-17): RuntimeError: a bug"
    ]
    assert errors[0].exc_info is None  # the traceback only at DEBUG
    assert gateway.metrics.internal_errors.labels("chat").value == 1
