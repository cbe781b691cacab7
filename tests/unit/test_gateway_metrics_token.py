"""The gateway's /metrics names tenants and their usage: only a caller with the metrics token
reads it; a client key (of any tenant) does not, and a refusal is counted."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key, parse_config
from hpcserve.contracts.engine_token import bearer_matches
from hpcserve.gateway.app import Gateway, build_app

KEY = "sk-tenant-key"
TOKEN = "metrics-token-value"


@pytest.fixture
def client(router):
    config = GatewayConfig(api_keys=[ApiKey(tenant="secret-project", sha256=hash_api_key(KEY))])
    gateway = Gateway(
        config,
        routing_endpoint=router.config.routing_bind,
        configured_models={"tiny"},
        metrics_token=TOKEN,
    )
    with TestClient(build_app(gateway)) as client:
        client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={})
        yield client


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": f"Bearer {KEY}"},  # a tenant's key is not the metrics token
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},  # not a bearer token
        {"Authorization": f"Basic {TOKEN}"},
    ],
)
def test_metrics_without_the_token_is_401_in_openais_shape(client, headers):
    answer = client.get("/metrics", headers=headers)
    assert answer.status_code == 401
    error = answer.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_metrics_token"
    assert "secret-project" not in answer.text


def test_metrics_with_the_token_names_tenants_and_counts_refusals(client):
    client.get("/metrics")
    answer = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    assert 'tenant="secret-project"' in answer.text
    assert 'hpcserve_gateway_auth_failures_total{reason="metrics"} 1.0' in answer.text


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {TOKEN}", True),
        (f"bearer {TOKEN}", True),
        (f"Bearer  {TOKEN} ", True),
        (f"Bearer {TOKEN}x", False),
        ("Bearer", False),
        ("", False),
    ],
)
def test_bearer_matches(header, ok):
    assert bearer_matches(header, TOKEN.encode()) is ok


def test_the_token_file_defaults_to_the_state_dirs_secrets(tmp_path):
    config = parse_config({"state_dir": str(tmp_path)})
    assert config.metrics_token_path() == str(tmp_path / "secrets" / "metrics-token")
    other = parse_config({"state_dir": str(tmp_path), "gateway": {"metrics_token_file": "/x/t"}})
    assert other.metrics_token_path() == "/x/t"
