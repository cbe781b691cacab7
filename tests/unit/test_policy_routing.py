"""Routing decisions end to end over the Decider: prefix affinity, load, and the hot-spot
regressions (shared system prompt, misses at low concurrency, long contexts, stale state)."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from hpcserve.config import RoutingConfig
from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts import protocol as p
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.router.decide import Decider
from hpcserve.router.kv_subscriber import KvEventSubscriber
from hpcserve.router.prefix_index import PrefixIndex
from hpcserve.router.registry import Registry

BS = 16
_open: list[KvEventSubscriber] = []


@pytest.fixture(autouse=True)
def _close_subscribers():
    yield
    while _open:
        _open.pop().close()


class Fleet:
    """Replicas whose 'engine' stores every routed prompt's blocks at once (as vLLM's
    BlockStored would), so the index sees what real engines would publish."""

    def __init__(self, n=3, events=True, seed=0, **routing):
        self.clock = 0.0
        self.registry = Registry(lease_s=1e9)
        subscriber = KvEventSubscriber(PrefixIndex(), clock=lambda: self.clock) if events else None
        if subscriber is not None:
            _open.append(subscriber)
        self.decider = Decider(
            RoutingConfig(**routing),
            self.registry,
            index=subscriber.index if subscriber else None,
            subscriber=subscriber,
            rng=random.Random(seed),
        )
        self.registry.on_add.append(self.decider.replica_added)
        self.registry.on_remove.append(self.decider.replica_removed)
        self.events = events
        self.ids = [f"r{i}" for i in range(n)]
        self._engine_ids: dict[tuple[str, int], int] = {}
        for rid in self.ids:
            self.registry.register(
                p.Register(
                    rid,
                    "m",
                    f"http://{rid}",
                    block_size=BS,
                    kv_events_endpoint="tcp://127.0.0.1:1" if events else "",
                    kv_events_topic=rid,
                ),
                0.0,
            )

    def route(self, tokens, session="", priority="interactive", store=True):
        hashes = prompt_block_hashes(tokens, BS)
        msg = p.Route(
            1,
            "m",
            block_hashes=hashes,
            block_size=BS,
            prompt_tokens=len(tokens),
            session_key=session,
            priority=priority,
        )
        replica = self.decider.pick(msg, self.clock)
        assert replica is not None
        if store and self.events:
            self.store(replica.replica_id, tokens)
        return replica.replica_id

    def store(self, rid, tokens):
        n = len(tokens) // BS
        hashes = [hash((rid, tuple(tokens[: (i + 1) * BS]))) & (2**63 - 1) for i in range(n)]
        self.decider.index.apply(rid, [kw.BlockStored(hashes, None, tokens[: n * BS], BS)])
        return hashes

    def release(self, rid):
        self.registry.released(rid)


def prompt(prefix_len, unique, tag):
    rng = random.Random(tag)
    return [7] * prefix_len + [rng.randrange(1000) for _ in range(unique)]


def test_the_replica_holding_the_prefix_wins_at_equal_load():
    fleet = Fleet(max_share=1.0)  # six in a row on one replica: past the share gate
    doc = prompt(0, 2048, "doc")
    first = fleet.route(doc)
    fleet.release(first)
    assert all(fleet.route(doc + [i] * 32) == first for i in range(5) if not fleet.release(first))


def test_one_shared_system_prompt_does_not_send_everything_to_one_replica():
    fleet = Fleet()
    window: deque[str] = deque()
    counts: Counter[str] = Counter()
    for i in range(600):
        rid = fleet.route(prompt(1024, 200, i))
        counts[rid] += 1
        window.append(rid)
        if len(window) > 12:  # 12 requests in flight at a time
            fleet.release(window.popleft())
    assert max(counts.values()) <= 600 / 2, counts
    assert len(counts) == 3


def test_cache_misses_at_low_concurrency_spread():
    fleet = Fleet()
    counts: Counter[str] = Counter()
    for i in range(300):
        rid = fleet.route(prompt(0, 300, i))
        counts[rid] += 1
        fleet.release(rid)  # one request at a time
    assert len(counts) == 3 and min(counts.values()) >= 60, counts


def test_new_long_contexts_go_where_the_kv_cache_has_room():
    fleet = Fleet()
    fleet.registry.heartbeat("r0", p.ReplicaLoad(kv_usage=0.9), 0.0)
    fleet.registry.heartbeat("r1", p.ReplicaLoad(kv_usage=0.2), 0.0)
    fleet.registry.heartbeat("r2", p.ReplicaLoad(kv_usage=0.1), 0.0)
    chosen = Counter()
    for i in range(50):
        rid = fleet.route(prompt(0, 4000, i), store=False)
        chosen[rid] += 1
        fleet.release(rid)
    assert chosen == {"r2": 50}


def test_long_contexts_in_flight_count_against_capacity():
    fleet = Fleet(tokens_per_request=1.0, kv_capacity_tokens=10_000)
    placed = [fleet.route(prompt(0, 4000, i), store=False) for i in range(6)]
    assert Counter(placed) == {"r0": 2, "r1": 2, "r2": 2}


def test_one_shared_system_prompt_spreads_even_one_request_at_a_time():
    # No queue ever forms, so the overload gate never fires: the share gate spreads it.
    fleet = Fleet()
    counts: Counter[str] = Counter()
    hits = 0
    for i in range(300):
        tokens = prompt(1024, 100, i)
        table = fleet.registry.table("m")
        request = fleet.decider.request_of(
            p.Route(1, "m", block_hashes=prompt_block_hashes(tokens, BS), block_size=BS), "m"
        )
        cached = fleet.decider.cached_tokens(request, table)
        rid = fleet.route(tokens)
        hits += bool(cached is not None and cached.at(fleet.registry.get(rid).row))
        counts[rid] += 1
        fleet.release(rid)
    assert max(counts.values()) <= 300 * 0.45 and len(counts) == 3, counts
    assert hits >= 300 - 3, hits  # each replica misses the shared prompt once


def test_new_contexts_go_to_the_replica_whose_cache_holds_least():
    """Contexts sharing a short preamble: a capacity-blind prefix router piles them onto the
    replica that holds the preamble; with the replicas' KV capacity known, the KV events'
    blocks count as fill and new contexts spread."""
    placed = {}
    for weight in (1.0, 0.0):
        fleet = Fleet(kv_capacity_tokens=6 * 1024, kv_pressure_weight=weight, max_share=1.0)
        chosen: Counter[str] = Counter()
        for customer in range(12):
            fleet.clock += 1.0
            rid = fleet.route([5] * 64 + prompt(0, 1024, customer))  # 4 shared blocks
            chosen[rid] += 1
            fleet.release(rid)
        placed[weight] = chosen
    assert max(placed[1.0].values()) <= 5, placed
    assert max(placed[0.0].values()) >= 11, placed


def test_stale_prefix_state_follows_block_removed():
    fleet = Fleet()
    doc = prompt(0, 1024, "doc")
    first = fleet.route(doc, store=False)
    fleet.release(first)
    engine_hashes = fleet.store(first, doc)
    assert fleet.route(doc, store=False) == first
    fleet.release(first)
    fleet.decider.index.apply(first, [kw.BlockRemoved(engine_hashes)])
    table = fleet.registry.table("m")
    request = fleet.decider.request_of(
        p.Route(1, "m", block_hashes=prompt_block_hashes(doc, BS), block_size=BS), "m"
    )
    assert fleet.decider.cached_tokens(request, table) is None
    others = Counter()
    for _ in range(60):
        rid = fleet.route(doc, store=False)
        others[rid] += 1
        fleet.release(rid)
    assert len(others) == 3


def test_overload_gate_removes_the_cache_bonus():
    fleet = Fleet()
    doc = prompt(0, 4096, "doc")
    first = fleet.route(doc)
    for _ in range(9):
        fleet.registry.routed(fleet.registry.get(first))  # 10 requests queued there
    assert fleet.route(doc) != first


def test_session_affinity_sticks_until_the_replica_is_overloaded():
    fleet = Fleet(policy="least-load")
    first = fleet.route(prompt(0, 10, 0), session="s1")
    fleet.release(first)
    for i in range(5):
        assert fleet.route(prompt(0, 10, i), session="s1") == first
        fleet.release(first)
    for _ in range(10):
        fleet.registry.routed(fleet.registry.get(first))
    assert fleet.route(prompt(0, 10, 9), session="s1") != first


def test_session_affinity_expires():
    fleet = Fleet(policy="least-load", session_ttl_s=5.0)
    first = fleet.route([1] * 16, session="s")
    fleet.clock = 10.0
    fleet.registry.routed(fleet.registry.get(first))  # now the busiest
    assert fleet.route([1] * 16, session="s") != first


def test_batch_requests_yield_to_replicas_with_queued_interactive_work():
    fleet = Fleet(policy="least-load")
    fleet.registry.heartbeat("r0", p.ReplicaLoad(waiting=1), 0.0)
    fleet.registry.heartbeat("r1", p.ReplicaLoad(waiting=1), 0.0)
    assert {fleet.route([1] * 16, priority="batch") for _ in range(5)} == {"r2"}


def test_unroutable_replicas_are_never_chosen():
    fleet = Fleet()
    fleet.registry.set_routable("r1", False)
    seen = {fleet.route(prompt(0, 64, i)) for i in range(60)}
    assert seen == {"r0", "r2"}
    fleet.registry.set_routable("r1", True)
    assert "r1" in {fleet.route(prompt(0, 64, i)) for i in range(60)}


def test_candidates_narrow_the_choice():
    fleet = Fleet()
    only = [fleet.registry.get("r2")]
    assert {fleet.decider.pick(p.Route(1, "m"), 0.0, only).replica_id for _ in range(10)} == {"r2"}
    assert fleet.decider.pick(p.Route(1, "m"), 0.0, []) is None


def test_round_robin_and_least_load_baselines():
    rr = Fleet(policy="round-robin")
    assert [rr.route([1] * 16) for _ in range(6)] == ["r0", "r1", "r2"] * 2
    ll = Fleet(policy="least-load")
    placed = [ll.route([1] * 16) for _ in range(6)]
    assert Counter(placed) == {"r0": 2, "r1": 2, "r2": 2}


def test_a_prompt_is_pending_on_its_replica_until_the_engine_stores_it():
    # The engine's BlockStored comes after the prefill: meanwhile the same customer's next
    # request must find the replica the first one went to, not start a second prefill.
    fleet = Fleet(n=8, pending_ttl_s=10.0)
    doc = prompt(0, 2048, "doc")
    first = fleet.route(doc, store=False)
    for i in range(5):
        assert fleet.route(doc + [i] * 16, store=False) == first
        fleet.release(first)
    # Never stored (say the request was aborted): forgotten after pending_ttl_s.
    fleet.clock = 11.0
    fleet.decider.approx.expire(fleet.clock)
    assert fleet.decider.index.match(prompt_block_hashes(doc, BS)) == {}


@pytest.mark.parametrize("capacity", [448_000, 0], ids=["capacity-known", "capacity-unknown"])
def test_new_customers_go_to_empty_replicas_not_behind_a_shared_header(capacity):
    # Every customer's prompt starts with the same template header (one block): the
    # replicas holding a customer match that block. A new customer's full prefill must not
    # go to one whose customer's next requests would wait behind it for a one-block bonus
    # (min_prefix_tokens): before, all eight went to the first replica. With the engines'
    # KV capacity known, KV pressure sends each to an empty one; without, equally cold
    # replicas share them at random.
    fleet = Fleet(n=16, max_share=1.0)
    for rid in fleet.ids:
        fleet.registry.heartbeat(rid, p.ReplicaLoad(kv_capacity_tokens=capacity), 0.0)
    header = [5] * BS
    placed: Counter[str] = Counter()
    for customer in range(8):
        fleet.clock += 1.0  # the Decider refreshes what each replica holds at most every 50 ms
        rid = fleet.route(header + prompt(0, 3000, customer))
        fleet.release(rid)
        placed[rid] += 1
        fleet.clock += 1.0
        assert fleet.route(header + prompt(0, 3000, customer) + [1] * 32) == rid  # a hit
        fleet.release(rid)
    assert max(placed.values()) == 1 if capacity else max(placed.values()) <= 2, placed


def test_approximate_mode_remembers_routed_prefixes_with_a_ttl():
    fleet = Fleet(events=False, approx_ttl_s=30.0)
    doc = prompt(0, 2048, "doc")
    first = fleet.route(doc)
    fleet.release(first)
    assert fleet.route(doc + [1] * 16) == first
    fleet.release(first)
    fleet.clock = 100.0
    fleet.decider.approx.expire(fleet.clock)
    assert len(fleet.decider.index) == 0


def test_approximate_mode_is_bounded_per_replica():
    fleet = Fleet(n=1, events=False, approx_max_blocks=10)
    for i in range(5):
        fleet.route(prompt(0, 16 * 8, i))
    assert fleet.decider.approx.blocks("r0") == 10 and len(fleet.decider.index) == 10


def test_unknown_model_has_no_replica():
    fleet = Fleet()
    assert fleet.decider.pick(p.Route(1, "other"), 0.0) is None


@pytest.mark.parametrize("policy", ["kv-aware", "least-load", "round-robin"])
def test_every_policy_routes_and_counts_in_flight(policy):
    fleet = Fleet(policy=policy)
    rid = fleet.route(prompt(0, 64, 1))
    assert fleet.registry.get(rid).in_flight == 1
    fleet.release(rid)
    assert fleet.registry.get(rid).in_flight == 0
