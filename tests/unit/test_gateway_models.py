"""GET /v1/models and /v1/models/{model} (the SDK's models.list and models.retrieve): the
real gateway app and a real router in a thread (with a real alias registry and an engine
agent holding a LoRA adapter); a tenant sees only the models it may use."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, TenantConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.router.adapters import AdapterCatalog, AdapterRouter, AdapterSource
from hpcserve.router.aliases import AliasCatalog, AliasRouter
from hpcserve.router.server import RouterServer
from tests.routers import alias_registry, loopback_router_config, running_router

TENANTS = [
    TenantConfig(name="open"),
    TenantConfig(name="team", allowed_models=["extraction", "docs-a", "idle"]),
]
ADAPTERS = [AdapterSource("docs-a", "docs@1", "/shared/docs-a", b'{"files": []}')]


@pytest.fixture
def router(tmp_path: Path) -> Iterator[RouterServer]:
    aliases = AliasRouter(
        AliasCatalog.from_registry(str(alias_registry(tmp_path)), refresh_s=0.0),
        rng=random.Random(1),
    )
    adapters = AdapterRouter(AdapterCatalog(lambda: ADAPTERS))
    config = loopback_router_config(lease_s=600.0)  # no heartbeats here
    with running_router(config, aliases=aliases, adapters=adapters) as server:
        # docs@1 served as docs-v1 by an engine agent that may load one adapter
        agent = RegistryAgent(
            config.registry_bind,
            p.Register(
                "r1", "docs-v1", "http://127.0.0.1:9", model_ref="docs@1",
                max_adapters=1, base_model="docs@1",
            ),
        )  # fmt: skip
        try:
            agent.register()
            agent.process_replies(30.0)
            assert agent.registered
            server.registry.register(p.Register("r2", "org/model-8b", "http://x"), now=1e12)
            yield server
        finally:
            agent.close()


@pytest.fixture
def client(router: RouterServer) -> Iterator[TestClient]:
    config = GatewayConfig(
        api_keys=[ApiKey(tenant=t.name, sha256=hash_api_key(f"sk-{t.name}")) for t in TENANTS],
        tenants=TENANTS,
        route_timeout_s=60.0,
    )
    gateway = Gateway(
        config,
        routing_endpoint=router.config.routing_bind,
        configured_models={"docs-v1", "org/model-8b", "idle"},
    )
    with TestClient(build_app(gateway)) as client:
        yield client


def sdk(client: TestClient, tenant: str = "open") -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=f"sk-{tenant}", http_client=client, max_retries=0
    )


def test_retrieve_answers_each_kind_of_model_as_the_list_does(client: TestClient) -> None:
    models = sdk(client)
    listed = {m.id: m.model_dump() for m in models.models.list()}
    assert sorted(listed) == ["docs-a", "docs-v1", "extraction", "org/model-8b"]
    for name, entry in listed.items():
        assert models.models.retrieve(name).model_dump() == entry
    served = models.models.retrieve("docs-v1")
    assert (served.id, served.object, served.owned_by) == ("docs-v1", "model", "hpcserve")
    assert served.replicas == 1  # type: ignore[attr-defined]
    # an alias names its version; an adapter its base model (vLLM's `parent`)
    assert listed["extraction"]["alias_of"] == "docs@1"
    assert listed["docs-a"]["parent"] == "docs-v1"
    # a served name with a slash: the SDK percent-encodes it
    assert models.models.retrieve("org/model-8b").id == "org/model-8b"


def test_a_configured_model_without_a_replica_exists_with_none(client: TestClient) -> None:
    idle = sdk(client).models.retrieve("idle")
    assert (idle.id, idle.replicas) == ("idle", 0)  # type: ignore[attr-defined]


def test_an_unknown_model_is_a_404_in_openai_shape(client: TestClient) -> None:
    response = client.get("/v1/models/gpt-9", headers={"Authorization": "Bearer sk-open"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model 'gpt-9' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(openai.NotFoundError):
        sdk(client).models.retrieve("docs-b")
    assert client.get("/v1/models/docs-v1").status_code == 401


def test_a_tenant_sees_only_its_allowed_models(client: TestClient) -> None:
    team = sdk(client, "team")
    assert sorted(m.id for m in team.models.list()) == ["docs-a", "extraction"]
    assert team.models.retrieve("extraction").alias_of == "docs@1"  # type: ignore[attr-defined]
    assert team.models.retrieve("idle").replicas == 0  # type: ignore[attr-defined]
    for hidden in ("docs-v1", "org/model-8b"):
        with pytest.raises(openai.NotFoundError) as err:
            team.models.retrieve(hidden)
        assert err.value.code == "model_not_found"
