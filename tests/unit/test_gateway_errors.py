"""The gateway with a real router and no engine: auth, validation and OpenAI-shaped errors."""

import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.gateway.app import Gateway, build_app

KEY = "sk-test-123"


@pytest.fixture
def client(router):
    config = GatewayConfig(
        api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))],
        max_body_bytes=1000,
        route_timeout_s=60.0,  # the router (a thread here) answers however loaded the machine
    )
    gateway = Gateway(
        config, routing_endpoint=router.config.routing_bind, configured_models={"tiny"}
    )
    with TestClient(build_app(gateway)) as client:
        yield client


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def error_of(response):
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "Missing API key"),
        ({"Authorization": "Basic abc"}, "Malformed Authorization header"),
        ({"Authorization": "Bearer wrong"}, "Invalid API key"),
    ],
)
def test_401_without_a_valid_key(client, headers, message):
    response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == 401
    err = error_of(response)
    assert message in err["message"] and err["type"] == "authentication_error"
    assert "wrong" not in err["message"]  # the offered key is never echoed


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "not a JSON object"),
        (b'{"messages": [{"role": "user"}]}', 400, "model", "'model' is required"),
        (b'{"model": "tiny", "messages": []}', 400, "messages", "expected array of length >= 1"),
        (b'{"model": "tiny", "stream": "yes"}', 400, "stream", "stream: expected bool, got str"),
        (
            b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}',
            404,
            "model",
            "The model 'gpt-9' does not exist",
        ),
        (b'{"model": "' + b"x" * 2000 + b'"}', 413, None, "exceeds the limit of 1000 bytes"),
    ],
)
def test_bad_requests(client, body, status, param, message):
    response = client.post(
        "/v1/chat/completions", content=body, headers=AUTH | {"Content-Type": "application/json"}
    )
    assert response.status_code == status
    err = error_of(response)
    assert message in err["message"] and err["param"] == param


def test_configured_model_without_replica_is_503_with_retry_after(client):
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=AUTH)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert error_of(response)["code"] == "no_replica"


def test_unreachable_replica_is_502_and_releases_in_flight(client, router):
    router.registry.register(p.Register("dead", "tiny", "http://127.0.0.1:9"), now=1e12)
    response = client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 502
    assert error_of(response)["code"] == "upstream_unreachable"
    metrics = client.get("/metrics").text
    assert (
        'hpcserve_gateway_requests_total{endpoint="chat",model="tiny",status="502",tenant="t"} 1.0'
        in metrics
    )
    assert "hpcserve_gateway_in_flight 0.0" in metrics


def test_models_lists_live_models_only(client, router):
    assert client.get("/v1/models", headers=AUTH).json() == {"object": "list", "data": []}
    router.registry.register(p.Register("r", "tiny", "http://127.0.0.1:9"), now=1e12)
    data = client.get("/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["object"], m["replicas"]) for m in data] == [("tiny", "model", 1)]
    assert client.get("/v1/models").status_code == 401


def test_unknown_path_and_method_are_openai_shaped(client):
    assert error_of(client.get("/v1/nothing"))["code"] == "unknown_endpoint"
    assert client.get("/v1/chat/completions").status_code == 405
    assert client.get("/health").text == "ok"
