"""router/adapters.py: an adapter's requests go where it is loaded, or it is loaded on demand
on the least-loaded replica of its base model, least recently used adapter unloaded first."""

from __future__ import annotations

from pathlib import Path

from hpcserve.contracts import protocol as p
from hpcserve.router.adapters import (
    LOAD_FAILED,
    LOADING,
    NO_REPLICA,
    AdapterCatalog,
    AdapterRouter,
    AdapterSource,
)
from hpcserve.router.registry import Registry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


SOURCES = [
    AdapterSource("docs-a", "llama", "/shared/a", b'{"a": 1}'),
    AdapterSource("docs-b", "llama", "/shared/b", b'{"b": 1}'),
    AdapterSource("docs-c", "llama", "/shared/c", b'{"c": 1}'),
    AdapterSource("other", "mistral", "/shared/o", b'{"o": 1}'),
]


def make(clock: Clock, sources: list[AdapterSource] = SOURCES) -> tuple[AdapterRouter, Registry]:
    catalog = AdapterCatalog(lambda: list(sources), clock=clock)
    return AdapterRouter(catalog, load_timeout_s=30, clock=clock), Registry(lease_s=10)


def register(
    router: AdapterRouter,
    registry: Registry,
    rid: str,
    adapters: list[str],
    *,
    max_adapters: int = 2,
    base: str = "llama",
    waiting: int = 0,
    model_ref: str = "",
) -> None:
    msg = p.Register(
        replica_id=rid,
        model="chat",
        url=f"http://{rid}",
        load=p.ReplicaLoad(waiting=waiting),
        adapters=adapters,
        max_adapters=max_adapters,
        base_model=base,
        model_ref=model_ref,
    )
    registry.register(msg, 0.0)
    router.on_register(msg, peer=rid.encode())


def test_requests_go_to_replicas_that_have_the_adapter() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a"])
    register(router, registry, "r2", ["docs-b"])
    decision = router.route("docs-b", registry)
    assert [r.replica_id for r in decision.candidates] == ["r2"]
    assert decision.load is None and decision.error == ""


def test_missing_adapter_is_loaded_on_the_least_loaded_replica() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "busy", [], waiting=5)
    register(router, registry, "idle", [], waiting=0)
    decision = router.route("docs-a", registry)
    assert decision.error == LOADING and not decision.candidates
    assert decision.peer == b"idle"
    assert decision.load == p.LoadAdapter("idle", "docs-a", "/shared/a", b'{"a": 1}', [])
    # While it loads, further requests wait; no second load is sent.
    again = router.route("docs-a", registry)
    assert again.error == LOADING and again.load is None
    router.on_loaded(p.AdapterLoaded("idle", "docs-a", adapters=["docs-a"]))
    assert [r.replica_id for r in router.route("docs-a", registry).candidates] == ["idle"]


def test_a_replica_out_of_routing_neither_serves_nor_loads_adapters() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "sick", ["docs-a"])
    register(router, registry, "well", [], waiting=9)
    registry.set_routable("sick", False)
    decision = router.route("docs-a", registry)
    assert decision.error == LOADING and decision.peer == b"well"


def test_a_full_replica_unloads_its_least_recently_used_adapter() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a", "docs-b"], max_adapters=2)
    for now, adapter in ((101, "docs-a"), (102, "docs-b"), (103, "docs-a")):
        clock.now = now
        router.routed("r1", adapter)
        router.released("r1", adapter, idle=False)
    # docs-b is now the least recently used
    decision = router.route("docs-c", registry)
    assert decision.load is not None and decision.load.unload == ["docs-b"]
    assert decision.error == LOADING
    # Until the engine reports, docs-b counts as gone: its requests wait for a reload.
    router.on_loaded(p.AdapterLoaded("r1", "docs-c", adapters=["docs-a", "docs-c"]))
    assert router.route("docs-c", registry).candidates
    assert router.route("docs-b", registry).load is not None


def test_a_replica_with_room_is_preferred_among_equally_loaded_ones() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "a-full", ["docs-a", "docs-b"], max_adapters=2)
    register(router, registry, "b-room", ["docs-a"], max_adapters=2)
    decision = router.route("docs-c", registry)
    assert decision.load is not None
    assert (decision.load.replica_id, decision.load.unload) == ("b-room", [])


def test_only_replicas_of_the_adapters_base_model_with_lora_on() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "mistral", [], base="mistral")
    register(router, registry, "no-lora", [], max_adapters=0)
    assert router.route("docs-a", registry).error == NO_REPLICA
    assert router.route("no-such-adapter", registry).error == NO_REPLICA
    assert router.route("other", registry).load is not None


def test_a_failed_load_is_reported_once_then_tried_again() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", [])
    assert router.route("docs-a", registry).load is not None
    router.on_loaded(p.AdapterLoaded("r1", "docs-a", error="digest mismatch", adapters=[]))
    assert router.route("docs-a", registry).error == LOAD_FAILED
    assert router.route("docs-a", registry).load is not None


def test_a_load_without_an_answer_times_out() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", [])
    assert router.route("docs-a", registry).load is not None
    clock.now += 31
    assert router.route("docs-a", registry).error == LOAD_FAILED
    assert router.route("docs-a", registry).load is not None


def test_heartbeats_replace_the_loaded_set_and_dead_replicas_are_dropped() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a"])
    router.on_heartbeat(p.Heartbeat("r1", adapters=["docs-b"]), peer=b"r1")
    assert router.route("docs-b", registry).candidates
    router.on_heartbeat(p.Heartbeat("r1"), peer=b"r1")  # None: unchanged
    assert router.route("docs-b", registry).candidates
    registry.deregister("r1", "test")
    assert router.route("docs-b", registry).error == NO_REPLICA


def test_listing_shows_loaded_and_loadable_adapters_with_their_parent() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a"])
    register(router, registry, "r2", ["docs-a", "docs-b"])
    listing = {m.id: (m.replicas, m.parent) for m in router.listing(registry)}
    assert listing == {
        "docs-a": (2, "chat"),
        "docs-b": (1, "chat"),
        "docs-c": (0, "chat"),  # in the registry, loadable on demand
    }  # "other" needs a mistral replica: not listed


def test_catalog_rereads_the_registry_on_a_miss_at_most_once_a_second() -> None:
    clock = Clock()
    reads: list[float] = []
    sources: list[AdapterSource] = []

    def read() -> list[AdapterSource]:
        reads.append(clock.now)
        return list(sources)

    catalog = AdapterCatalog(read, refresh_s=30, miss_refresh_s=1, clock=clock)
    assert catalog.get("docs-a") is None
    assert catalog.get("docs-a") is None
    assert len(reads) == 1
    sources.append(SOURCES[0])
    clock.now += 1.5
    assert catalog.get("docs-a") == SOURCES[0]
    assert len(reads) == 2


def test_catalog_keeps_the_last_good_table_when_the_registry_cannot_be_read() -> None:
    clock = Clock()
    calls = 0

    def read() -> list[AdapterSource]:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OSError("registry moved")
        return SOURCES[:1]

    catalog = AdapterCatalog(read, refresh_s=1, clock=clock)
    assert catalog.get("docs-a") is not None
    clock.now += 5
    assert catalog.get("docs-a") is not None


def test_catalog_from_a_registry_file(tmp_path: Path) -> None:
    from hpcserve.modelcache.manifest import build_manifest
    from hpcserve.modelcache.registry import Registry as ModelRegistry
    from hpcserve.tinymodels import make_tiny_model

    root = tmp_path
    adapter = make_tiny_model("lora", root / "lora", seed=1)
    base = root / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    with ModelRegistry(root / "reg.sqlite3") as reg:
        reg.add_version("llama", str(base), build_manifest(base))
        reg.add_adapter("docs-a", "llama", str(adapter), build_manifest(adapter), rank=8)
    catalog = AdapterCatalog.from_registry(str(root / "reg.sqlite3"))
    found = catalog.get("docs-a")
    assert found is not None and (found.base_model, found.source) == ("llama", str(adapter))
    assert found.base_version == 1
    assert b"adapter_model.safetensors" in found.manifest
    assert AdapterCatalog.from_registry(str(root / "missing.sqlite3")).all() == []


# -- requests in flight per adapter (never unloaded while busy on that replica)


def _route_and_hold(router: AdapterRouter, rid: str, adapter: str, at: float, clock: Clock) -> None:
    clock.now = at
    router.routed(rid, adapter)


def test_an_adapter_with_requests_in_flight_is_not_unloaded() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a", "docs-b"], max_adapters=2)
    _route_and_hold(router, "r1", "docs-a", 101, clock)  # still running: the LRU one
    _route_and_hold(router, "r1", "docs-b", 102, clock)
    router.released("r1", "docs-b", idle=False)
    decision = router.route("docs-c", registry)
    assert decision.load is not None and decision.load.unload == ["docs-b"]
    assert router.in_flight("r1", "docs-a") == 1


def test_a_replica_whose_adapters_are_all_busy_takes_no_load() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "busy", ["docs-a", "docs-b"], max_adapters=2)
    register(router, registry, "other", ["docs-a", "docs-b"], max_adapters=2, waiting=5)
    for adapter in ("docs-a", "docs-b"):
        _route_and_hold(router, "busy", adapter, 101, clock)
    # The less loaded replica cannot make room: the load goes to the other one.
    decision = router.route("docs-c", registry)
    assert decision.load is not None and decision.load.replica_id == "other"


def test_when_every_replica_is_busy_the_request_waits_until_one_ends() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a", "docs-b"], max_adapters=2)
    for adapter in ("docs-a", "docs-b", "docs-b"):
        _route_and_hold(router, "r1", adapter, 101, clock)
    waiting = router.route("docs-c", registry)
    assert (waiting.error, waiting.load) == (LOADING, None)
    router.released("r1", "docs-b", idle=False)
    assert router.route("docs-c", registry).load is None  # one docs-b request still runs
    router.released("r1", "docs-b", idle=False)
    decision = router.route("docs-c", registry)
    assert decision.load is not None and decision.load.unload == ["docs-b"]


def test_a_release_naming_no_model_clears_the_counts_once_the_replica_is_idle() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a", "docs-b"], max_adapters=2)
    _route_and_hold(router, "r1", "docs-a", 101, clock)
    _route_and_hold(router, "r1", "docs-b", 102, clock)
    router.released("r1", "", idle=False)  # an older gateway: which request is unknown
    assert router.in_flight("r1", "docs-a") == router.in_flight("r1", "docs-b") == 1
    router.released("r1", "", idle=True)
    assert router.in_flight("r1", "docs-a") == router.in_flight("r1", "docs-b") == 0
    decision = router.route("docs-c", registry)
    assert decision.load is not None and decision.load.unload == ["docs-a"]


def test_in_flight_counts_survive_a_repeated_register() -> None:
    clock = Clock()
    router, registry = make(clock)
    register(router, registry, "r1", ["docs-a"], max_adapters=1)
    _route_and_hold(router, "r1", "docs-a", 101, clock)
    register(router, registry, "r1", ["docs-a"], max_adapters=1)
    assert router.in_flight("r1", "docs-a") == 1
    assert router.route("docs-b", registry).load is None


# -- adapters bound to a base version


VERSIONED = [
    AdapterSource("docs-v2", "llama", "/shared/v2", b'{"v": 2}', base_version=2),
    AdapterSource("docs-any", "llama", "/shared/any", b'{"v": 0}'),
]


def test_an_adapter_bound_to_a_version_loads_only_on_replicas_of_that_version() -> None:
    clock = Clock()
    router, registry = make(clock, VERSIONED)
    register(router, registry, "v1", [], model_ref="llama@1")  # idle: would be picked
    register(router, registry, "v2", [], model_ref="llama@2", waiting=7)
    decision = router.route("docs-v2", registry)
    assert decision.load is not None and decision.load.replica_id == "v2"
    # A version-less catalog entry (an older registry) still goes by the model name.
    assert router.route("docs-any", registry).peer == b"v1"


def test_no_replica_of_the_bound_version_means_no_replica() -> None:
    clock = Clock()
    router, registry = make(clock, VERSIONED)
    register(router, registry, "v1", [], model_ref="llama@1")
    register(router, registry, "path", [])  # a model_path pool: its version is unknown
    assert router.route("docs-v2", registry).error == NO_REPLICA


def test_a_replica_of_another_version_holding_the_adapter_is_not_a_candidate() -> None:
    clock = Clock()
    router, registry = make(clock, VERSIONED)
    register(router, registry, "v1", ["docs-v2"], model_ref="llama@1")
    register(router, registry, "v2", ["docs-v2"], model_ref="llama@2")
    decision = router.route("docs-v2", registry)
    assert [r.replica_id for r in decision.candidates] == ["v2"]


def test_listing_names_only_the_bound_versions_replicas_as_parent() -> None:
    clock = Clock()
    router, registry = make(clock, VERSIONED)
    register(router, registry, "v1", [], model_ref="llama@1")
    assert {m.id for m in router.listing(registry)} == {"docs-any"}
