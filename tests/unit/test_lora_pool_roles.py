"""LoRA adapters and pool roles: an adapter's request runs on, and loads onto, only the
replicas its priority may use (router/policies/pool_roles.py's rule, router/adapters.py)."""

from __future__ import annotations

import pytest

from hpcserve.contracts import protocol as p
from hpcserve.router.adapters import LOADING, AdapterCatalog, AdapterRouter, AdapterSource
from hpcserve.router.registry import Registry

SOURCES = [AdapterSource("docs-a", "llama", "/shared/a", b"{}")]


def fleet(*replicas: tuple[str, str, list[str], int]) -> tuple[AdapterRouter, Registry]:
    """(replica id, role, adapters loaded, waiting) each."""
    router = AdapterRouter(AdapterCatalog(lambda: list(SOURCES)), load_timeout_s=30)
    registry = Registry(lease_s=10)
    for rid, role, adapters, waiting in replicas:
        msg = p.Register(
            replica_id=rid, model="chat", url=f"http://{rid}", pool=role,
            load=p.ReplicaLoad(waiting=waiting), adapters=adapters, max_adapters=2,
            base_model="llama", role=role,
        )  # fmt: skip
        registry.register(msg, 0.0)
        router.on_register(msg, peer=rid.encode())
    return router, registry


def loads_on(router: AdapterRouter, registry: Registry, priority: str, lend: int = 0) -> str:
    decision = router.route("docs-a", registry, priority=priority, lend_below=lend)
    assert decision.error == LOADING and decision.load is not None
    return decision.load.replica_id


@pytest.mark.parametrize(
    ("priority", "lend", "waiting", "target"),
    [
        # The interactive replica is the least loaded, yet batch work loads on the batch pool.
        ("batch", 0, (0, 3, 1), "b1"),
        # ... unless lending applies: nothing waits there and its load is under lend_below.
        ("batch", 5, (0, 3, 1), "i1"),
        ("batch", 5, (2, 3, 1), "b1"),
        # Interactive work never loads onto the batch pool, though it is the least loaded.
        ("interactive", 0, (2, 3, 1), "i1"),
    ],
)
def test_the_load_goes_to_the_least_loaded_replica_of_the_requests_role(
    priority: str, lend: int, waiting: tuple[int, int, int], target: str
) -> None:
    router, registry = fleet(
        ("i1", "interactive", [], waiting[0]),
        ("i2", "interactive", [], waiting[1]),
        ("b1", "batch", [], waiting[2]),
    )
    assert loads_on(router, registry, priority, lend) == target


def test_a_holder_of_the_other_role_is_no_candidate() -> None:
    router, registry = fleet(("i1", "interactive", ["docs-a"], 0), ("b1", "batch", [], 0))
    # Loaded only on the interactive replica: a batch request has it loaded on the batch pool.
    assert loads_on(router, registry, "batch") == "b1"
    router, registry = fleet(("i1", "interactive", [], 0), ("b1", "batch", ["docs-a"], 0))
    assert loads_on(router, registry, "interactive") == "i1"
    decision = router.route("docs-a", registry, priority="batch")
    assert [r.replica_id for r in decision.candidates] == ["b1"]


def test_without_a_replica_of_its_role_a_request_uses_the_others() -> None:
    router, registry = fleet(("b1", "batch", [], 0))
    assert loads_on(router, registry, "interactive") == "b1"  # slower beats refused
    router, registry = fleet(("i1", "interactive", [], 0))
    assert loads_on(router, registry, "batch") == "i1"  # a model without a batch pool
    router, registry = fleet(("i1", "interactive", [], 0), ("b1", "batch", [], 0))
    registry.set_routable("b1", False)  # the batch pool out of routing (draining)
    assert loads_on(router, registry, "batch") == "i1"


def test_the_router_passes_the_requests_priority_to_adapter_placement() -> None:
    from hpcserve.router.server import RouterServer
    from tests.routers import loopback_router_config

    router = AdapterRouter(AdapterCatalog(lambda: list(SOURCES)), load_timeout_s=30)
    server = RouterServer(loopback_router_config(), adapters=router)
    for rid, role, adapters in (("i1", "interactive", ["docs-a"]), ("b1", "batch", [])):
        msg = p.Register(
            replica_id=rid, model="chat", url=f"http://{rid}", pool=role, adapters=adapters,
            max_adapters=2, base_model="llama", role=role,
        )  # fmt: skip
        server.registry.register(msg, 0.0)
        router.on_register(msg, peer=rid.encode())
    try:
        # Loaded only on the interactive replica: a batch line waits for it on the batch pool.
        assert server.route(p.Route(1, "docs-a", priority="batch")).error == LOADING
        assert server.route(p.Route(2, "docs-a")).replica_id == "i1"
    finally:
        server.kv_events.close()  # the one socket a router that never started holds
