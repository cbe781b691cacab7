"""Aliases and canaries in routing (router/aliases.py): resolution, the canary split and its
stickiness, promote without a restart, /v1/models listing; a real router in a thread and a
real registry database."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from hpcserve.contracts import protocol as p
from hpcserve.contracts.router_client import list_models
from hpcserve.modelcache.registry import Alias
from hpcserve.modelcache.registry import Registry as ModelRegistry
from hpcserve.router.aliases import ALIAS_NO_REPLICA, AliasCatalog, AliasRouter, sticky_draw
from hpcserve.router.server import RouterServer
from tests.routers import alias_registry, loopback_router_config, running_router


def test_the_sticky_draw_is_fixed_per_user_and_uniform_over_users() -> None:
    assert sticky_draw("extraction", "alice") == sticky_draw("extraction", "alice")
    assert sticky_draw("extraction", "alice") != sticky_draw("summaries", "alice")
    canary = Alias("extraction", "docs@1", "docs@2", 25, 0.0)
    picks = [canary.pick(sticky_draw("extraction", f"user-{i}")) for i in range(10_000)]
    assert picks.count("docs@2") / len(picks) == pytest.approx(0.25, abs=0.02)


def test_raising_the_canary_share_only_moves_users_onto_the_canary() -> None:
    draws = [sticky_draw("extraction", f"user-{i}") for i in range(1000)]
    at_10 = {i for i, u in enumerate(draws) if Alias("a", "v1", "v2", 10, 0.0).pick(u) == "v2"}
    at_50 = {i for i, u in enumerate(draws) if Alias("a", "v1", "v2", 50, 0.0).pick(u) == "v2"}
    assert at_10 < at_50


@pytest.fixture
def registry_db(tmp_path: Path) -> Path:
    return alias_registry(tmp_path)


@pytest.fixture
def router(registry_db: Path) -> Iterator[RouterServer]:
    catalog = AliasCatalog.from_registry(str(registry_db), refresh_s=0.0)
    aliases = AliasRouter(catalog, rng=random.Random(7))
    with running_router(loopback_router_config(lease_s=60.0), aliases=aliases) as server:
        for replica_id, model, ref in (
            ("v1-a", "docs-v1", "docs@1"),
            ("v1-b", "docs-v1", "docs@1"),
            ("v2-a", "docs-v2", "docs@2"),
        ):
            url = f"http://{replica_id}"
            server.registry.register(p.Register(replica_id, model, url, model_ref=ref), now=1e12)
        yield server


@pytest.fixture
def gateway(router: RouterServer) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router.config.routing_bind)
    yield sock
    sock.close()


def route(sock: zmq.Socket, request_id: int, model: str, **fields: str) -> p.RouteReply:
    sock.send(p.encode(p.Route(request_id, model, **fields)))  # type: ignore[arg-type]
    assert sock.poll(5000), "the router did not answer"
    reply = p.routing_reply_decoder.decode(sock.recv())
    assert isinstance(reply, p.RouteReply)
    return reply


def test_an_alias_routes_to_the_replicas_of_its_version_under_their_served_name(
    router: RouterServer, gateway: zmq.Socket
) -> None:
    replies = [route(gateway, i, "extraction") for i in range(6)]
    assert {r.replica_id for r in replies} == {"v1-a", "v1-b"}
    assert {r.model for r in replies} == {"docs-v1"}
    # A served name is routed as before, and the reply names no other model.
    direct = route(gateway, 10, "docs-v2")
    assert (direct.replica_id, direct.model) == ("v2-a", "")
    assert route(gateway, 11, "nothing").error == "no_replica"


def test_a_canary_splits_its_share_keeps_a_user_and_promote_flips_it(
    router: RouterServer, gateway: zmq.Socket, registry_db: Path
) -> None:
    with ModelRegistry(registry_db) as reg:
        reg.promote("extraction", "docs@2", 25)
    versions = [route(gateway, i, "extraction").model for i in range(400)]
    assert versions.count("docs-v2") / 400 == pytest.approx(0.25, abs=0.08)
    for key in ("session_key", "user"):
        for user in ("alice", "bob", "carol"):
            seen = {route(gateway, i, "extraction", **{key: user}).model for i in range(10)}
            assert len(seen) == 1, f"{key} {user} flipped between versions: {seen}"
    with ModelRegistry(registry_db) as reg:
        reg.promote("extraction", "docs@2")  # 100%: the new target, no canary
    assert {route(gateway, i, "extraction").model for i in range(20)} == {"docs-v2"}


def test_an_alias_whose_version_has_no_replica_is_known_but_unserved(
    router: RouterServer, gateway: zmq.Socket, registry_db: Path
) -> None:
    for replica_id in ("v1-a", "v1-b"):
        router.registry.deregister(replica_id, "test")
    assert route(gateway, 1, "extraction").error == ALIAS_NO_REPLICA


def test_models_lists_a_served_alias_with_its_version(
    router: RouterServer, registry_db: Path
) -> None:
    listed = {m.id: m for m in list_models(router.config.routing_bind)}
    assert listed["extraction"].alias_of == "docs@1" and listed["extraction"].replicas == 2
    with ModelRegistry(registry_db) as reg:
        reg.set_alias("unserved", "docs@1")
    for replica_id in ("v1-a", "v1-b"):
        router.registry.deregister(replica_id, "test")
    listed = {m.id: m for m in list_models(router.config.routing_bind)}
    assert "extraction" not in listed and "unserved" not in listed and "docs-v2" in listed
