"""Aliases and canaries end to end: two simulated engines serve two versions of one registry
model (as two pools would), the real router reads the alias from the real registry database,
the real gateway app relays; `hpcserve models promote` changes the split without a restart."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, TenantConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.modelcache.evaluations import Evaluation
from hpcserve.modelcache.registry import Registry as ModelRegistry
from hpcserve.router.aliases import AliasCatalog, AliasRouter
from hpcserve.router.server import RouterServer
from tests.ports import free_port
from tests.routers import alias_registry, loopback_router_config, running_router
from tests.services import service, sim_engine_argv

REFRESH_S = 0.2
MESSAGES = [{"role": "user", "content": "extract the invoice number"}]
TENANTS = [
    TenantConfig(name="team", allowed_models=["extraction"]),
    TenantConfig(name="open"),
]


@pytest.fixture(scope="module")
def registry_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = alias_registry(tmp_path_factory.mktemp("alias-registry"))
    with ModelRegistry(path) as reg:  # `models promote` moves traffic only past the gate
        reg.record_evaluation(
            Evaluation(ref="docs@2", suite="routing", suite_digest="0" * 64, suite_path="-",
                       cases=1, scores={"ok": 100.0}, key_metrics=["ok"], passed=True)
        )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, str]]:
    """docs@1 served as docs-v1, docs@2 as docs-v2: one simulated engine each."""
    ports = {"docs-v1": free_port(), "docs-v2": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    with (
        service(sim_engine_argv(ports["docs-v1"], "docs-v1", 0.1), urls["docs-v1"]),
        service(sim_engine_argv(ports["docs-v2"], "docs-v2", 0.1), urls["docs-v2"]),
    ):
        yield urls


@pytest.fixture
def client(registry_db: Path, engines: dict[str, str]) -> Iterator[TestClient]:
    catalog = AliasCatalog.from_registry(str(registry_db), refresh_s=REFRESH_S)
    # A seeded draw for requests without a session or user: the measured share repeats.
    aliases = AliasRouter(catalog, rng=random.Random(2026))
    with running_router(loopback_router_config(lease_s=600.0), aliases=aliases) as r:
        for version, name in ((1, "docs-v1"), (2, "docs-v2")):
            register(r, name, engines[name], f"docs@{version}")
        config = GatewayConfig(
            api_keys=[ApiKey(tenant=t.name, sha256=hash_api_key(f"sk-{t.name}")) for t in TENANTS],
            tenants=TENANTS,
        )
        gateway = Gateway(
            config, routing_endpoint=r.config.routing_bind, configured_models=set(engines)
        )
        with TestClient(build_app(gateway)) as client:
            yield client


def register(router: RouterServer, model: str, url: str, ref: str) -> None:
    router.registry.register(p.Register(model, model, url, pool=model, model_ref=ref), now=1e12)


def sdk(client: TestClient, tenant: str = "open") -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=f"sk-{tenant}", http_client=client
    )


def answered_by(client: openai.OpenAI, **extra: object) -> str:
    reply = client.chat.completions.create(
        model="extraction",
        messages=MESSAGES,
        max_tokens=1,
        **extra,  # type: ignore[arg-type]
    )
    return reply.model


def promote(registry_db: Path, ref: str, share: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "models", "promote", "extraction", ref,
         "--share", str(share), "--registry", str(registry_db)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    time.sleep(REFRESH_S * 2)  # the router re-reads the registry; nothing restarts


def test_an_alias_is_listed_and_served_by_its_version(client: TestClient) -> None:
    listed = {m["id"]: m for m in client.get("/v1/models", headers=auth("open")).json()["data"]}
    assert listed["extraction"]["alias_of"] == "docs@1"
    assert {"docs-v1", "docs-v2"} <= listed.keys()
    # The answer's model names the version that served it (its pool's served name).
    assert {answered_by(sdk(client)) for _ in range(5)} == {"docs-v1"}


def test_allowed_models_takes_an_alias(client: TestClient) -> None:
    team = sdk(client, "team")
    assert answered_by(team) == "docs-v1"
    with pytest.raises(openai.PermissionDeniedError):
        team.chat.completions.create(model="docs-v1", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]


def test_a_canary_gets_its_share_users_stay_and_promote_flips_it(
    client: TestClient, registry_db: Path
) -> None:
    promote(registry_db, "docs@2", 25)
    try:
        models = sdk(client)
        n = 200
        canary = sum(answered_by(models) == "docs-v2" for _ in range(n))
        assert canary / n == pytest.approx(0.25, abs=0.06), f"{canary} of {n} on the canary"
        # One conversation (x-session-id) or one user stays on one version.
        for i in range(4):
            session = {"extra_headers": {"x-session-id": f"conversation-{i}"}}
            assert len({answered_by(models, **session) for _ in range(5)}) == 1
            assert len({answered_by(models, user=f"someone-{i}") for _ in range(5)}) == 1
        with ModelRegistry(registry_db) as reg:  # what `promote extraction docs@2` does
            reg.promote("extraction", "docs@2")
        time.sleep(REFRESH_S * 2)
        assert {answered_by(models, user=f"user-{i}") for i in range(20)} == {"docs-v2"}
    finally:
        with ModelRegistry(registry_db) as reg:
            reg.set_alias("extraction", "docs@1")


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{tenant}"}
