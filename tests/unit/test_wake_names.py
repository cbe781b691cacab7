"""Every name of a pool's model wakes the pool at zero (router/unserved.py,
poolmgr/wake_names.py): the router records an unserved alias or LoRA adapter under the
registry version it resolves to, and the pool manager counts that demand for the pool whose
model_ref resolves to the version. A real router in a thread, a real registry database."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcserve.config import GatewayConfig, PoolConfig, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.contracts.router_client import replica_list
from hpcserve.gateway.app import Gateway
from hpcserve.gateway.server import wake_versions
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry as ModelRegistry
from hpcserve.poolmgr.wake_names import PoolVersions, demand_by_model
from hpcserve.router.adapters import AdapterCatalog, AdapterRouter, AdapterSource
from hpcserve.router.aliases import AliasCatalog, AliasRouter
from hpcserve.router.server import RouterServer
from tests.routers import alias_registry, loopback_router_config, running_router

ADAPTERS = [
    AdapterSource("docs-lora", "docs", "/shared/docs-lora", b'{"files": []}', base_version=2),
    # An adapter the registry binds to no version (rows from before versions were bound).
    AdapterSource("old-lora", "docs", "/shared/old-lora", b'{"files": []}'),
]


@pytest.fixture
def router(tmp_path: Path) -> Iterator[RouterServer]:
    """docs@1 and docs@2 in the registry, extraction -> docs@1; no replica, except "v1"
    (docs@1 served as docs-v1) where a case registers it."""
    registry = alias_registry(tmp_path)
    aliases = AliasRouter(
        AliasCatalog.from_registry(str(registry), refresh_s=0.0), rng=random.Random(1)
    )
    adapters = AdapterRouter(AdapterCatalog(lambda: ADAPTERS))
    config = loopback_router_config(lease_s=600.0)
    with running_router(config, aliases=aliases, adapters=adapters) as server:
        yield server


@pytest.mark.parametrize(
    ("asked", "v1_up", "error", "names", "refs"),
    [
        # A served name: recorded as asked (the pool of that served name wakes on it).
        ("docs-v1", False, "no_replica", {"docs-v1"}, {}),
        # An alias with no replica: its version, which no replica could name.
        ("extraction", False, "alias_no_replica", {"extraction"}, {"docs@1"}),
        # An alias whose replicas are all excluded (a failover): the served name it routes to.
        ("extraction", True, "no_replica", {"extraction", "docs-v1"}, {}),
        # A LoRA adapter: its base version; one bound to no version: its base model.
        ("docs-lora", False, "no_replica", {"docs-lora"}, {"docs@2"}),
        ("old-lora", False, "no_replica", {"old-lora"}, {"docs"}),
        # A name nobody knows: as asked only (bounded as every name is).
        ("nobody", False, "no_replica", {"nobody"}, {}),
    ],
)
def test_the_router_records_an_unserved_name_under_what_it_resolves_to(
    router: RouterServer,
    asked: str,
    v1_up: bool,
    error: str,
    names: set[str],
    refs: dict[str, float],
) -> None:
    exclude = []
    if v1_up:
        spec = p.Register("v1", "docs-v1", "http://v1", model_ref="docs@1")
        router.registry.register(spec, now=1e12)
        exclude = ["v1"]
    assert router.route(p.Route(1, asked, exclude=exclude)).error == error
    listing = replica_list(router.config.routing_bind)
    assert set(listing.unserved) == names
    assert set(listing.unserved_refs) == set(refs)
    assert all(0 <= age < 60 for age in listing.unserved_refs.values())


def _pool(name: str, model_ref: str = "", served: str = "") -> PoolConfig:
    return PoolConfig(name=name, model_ref=model_ref, served_model_name=served)


POOLS = [
    _pool("v1", "docs@1", served="docs-v1"),
    _pool("v2", "docs", served="docs-v2"),  # the latest: docs@2
    _pool("ex", "extraction"),  # an alias: its target now, docs@1
    _pool("plain"),  # weights from a path: no registry version
]
VERSIONS = {"v1": "docs@1", "v2": "docs@2", "ex": "docs@1"}


@pytest.mark.parametrize(
    ("unserved", "unserved_refs", "woken"),
    [
        ({}, {}, {}),
        # By served name, as before.
        ({"docs-v1": 3.0, "plain": 1.0}, {}, {"docs-v1": 3.0, "plain": 1.0}),
        # A version: every pool serving it (the alias's target, and the pool on the alias).
        ({}, {"docs@1": 2.0}, {"docs-v1": 2.0, "ex": 2.0}),
        ({}, {"docs@2": 4.0}, {"docs-v2": 4.0}),
        # A base model (an adapter bound to no version): every pool of any version of it.
        ({}, {"docs": 5.0}, {"docs-v1": 5.0, "docs-v2": 5.0, "ex": 5.0}),
        # Both for one pool: the youngest age.
        ({"docs-v2": 9.0}, {"docs@2": 1.5}, {"docs-v2": 1.5}),
        ({"docs-v2": 0.5}, {"docs@2": 7.0}, {"docs-v2": 0.5}),
        # A version no pool serves, and a name no pool has: nobody wakes.
        ({"nobody": 1.0}, {"docs@7": 1.0, "other@1": 1.0}, {"nobody": 1.0}),
    ],
)
def test_the_pool_manager_counts_a_version_s_demand_for_the_pools_that_serve_it(
    unserved: dict[str, float], unserved_refs: dict[str, float], woken: dict[str, float]
) -> None:
    assert demand_by_model(POOLS, unserved, unserved_refs, VERSIONS) == woken


def test_pool_versions_resolve_refs_and_aliases_and_leave_out_the_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = alias_registry(tmp_path)
    pools = [*POOLS, _pool("gone", "missing@1")]
    versions = PoolVersions(registry, refresh_s=10.0)
    with caplog.at_level(logging.INFO, "hpcserve.poolmgr.wake_names"):
        assert versions.of(pools, now=0.0) == VERSIONS
        assert versions.of(pools, now=5.0) == VERSIONS  # cached: no second warning
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and warned[0].startswith("pool gone: its model_ref does not")
        # A promote moves the alias: seen at the next read, after refresh_s.
        with ModelRegistry(registry) as reg:
            reg.promote("extraction", "docs@2")
            source = tmp_path / "missing"
            source.mkdir()
            reg.add_version("missing", str(source), build_manifest(source))
        assert versions.of(pools, now=9.0)["ex"] == "docs@1"
        assert versions.of(pools, now=10.0) == {**VERSIONS, "ex": "docs@2", "gone": "missing@1"}
        assert caplog.records[-1].getMessage() == (
            "pool gone: its model_ref resolves again, to missing@1"
        )
    # No registry at all: nothing resolves, and nothing fails.
    assert PoolVersions(tmp_path / "none.sqlite3").of(pools, now=0.0) == {}


@pytest.mark.parametrize(
    ("asked", "reply", "pool"),
    [
        # A pool's served name: as before, whatever the router answers.
        ("docs-v1", p.RouteReply(1, error="no_replica"), "docs-v1"),
        ("docs-v1", None, "docs-v1"),
        # An alias or adapter with no replica: the pool at zero serving its version.
        ("extraction", p.RouteReply(1, error="alias_no_replica", model_ref="docs@1"), "docs-v1"),
        ("docs-lora", p.RouteReply(1, error="no_replica", model_ref="docs@2"), "ex-v2"),
        ("old-lora", p.RouteReply(1, error="no_replica", model_ref="docs"), "docs-v1"),
        # A version no pool at zero serves, a name nobody knows, a routed request: none.
        ("other", p.RouteReply(1, error="alias_no_replica", model_ref="docs@7"), ""),
        ("nobody", p.RouteReply(1, error="no_replica"), ""),
        ("extraction", p.RouteReply(1, "r1", "http://r1", model_ref="docs@1"), ""),
        ("docs-v1", p.RouteReply(1, "r1", "http://r1", model_ref="docs@1"), ""),
        ("extraction", None, ""),
    ],
)
def test_the_gateway_holds_an_alias_or_adapter_for_the_pool_at_zero_serving_its_version(
    asked: str, reply: p.RouteReply | None, pool: str
) -> None:
    gateway = Gateway(GatewayConfig(), routing_endpoint="tcp://127.0.0.1:9", configured_models=set())
    gateway.wake_budgets = {"docs-v1": 60.0, "ex-v2": 5.0}
    gateway.wake_versions = {"docs@1": "docs-v1", "docs@2": "ex-v2"}
    assert gateway._waking_pool(asked, reply) == pool


def test_the_gateway_reads_the_versions_of_its_pools_at_zero_from_the_registry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    alias_registry(tmp_path)
    at_zero = {"min": 0, "max": 1}
    config = parse_config({"state_dir": str(tmp_path), "engine": {"cache_dir": "/cache"}, "pools": [
        {"name": "v1", "model_ref": "extraction", "served_model_name": "docs-v1",
         "autoscale": at_zero},
        {"name": "v2", "model_ref": "docs", "autoscale": at_zero},  # the latest: docs@2
        {"name": "floor", "model_ref": "docs@1", "autoscale": {"min": 1, "max": 2}},
        {"name": "fixed", "model_ref": "docs@2"},
        {"name": "gone", "model_ref": "missing", "autoscale": at_zero},
    ]})  # fmt: skip
    with caplog.at_level(logging.WARNING, "hpcserve.gateway.server"):
        assert wake_versions(config) == {"docs@1": "docs-v1", "docs@2": "v2"}
    (warned,) = [r.getMessage() for r in caplog.records]
    assert warned.startswith("pool gone: requests for its aliases and adapters are not held")


def test_a_promote_reaches_the_gateway_without_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool whose model_ref is an alias follows a promote: a request for a version the
    gateway's map does not know re-reads the registry (at most every WAKE_VERSIONS_REREAD_S)."""
    from hpcserve.gateway import app as gateway_app
    from hpcserve.gateway.server import build_gateway_app

    path = alias_registry(tmp_path)
    config = parse_config({"state_dir": str(tmp_path), "engine": {"cache_dir": "/cache"}, "pools": [
        {"name": "ex", "model_ref": "extraction", "autoscale": {"min": 0, "max": 1}},
    ]})  # fmt: skip
    gateway = build_gateway_app(config).state.gateway
    assert gateway.wake_versions == {"docs@1": "ex"}
    with ModelRegistry(path) as registry:
        registry.promote("extraction", "docs@2")
    to_v2 = p.RouteReply(1, error="alias_no_replica", model_ref="docs@2")
    # read at start moments ago: not again yet
    assert gateway._waking_pool("extraction", to_v2) == ""
    monkeypatch.setattr(gateway_app, "WAKE_VERSIONS_REREAD_S", 0.0)
    assert gateway._waking_pool("extraction", to_v2) == "ex"
    assert gateway.wake_versions == {"docs@2": "ex"}
