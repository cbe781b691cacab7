"""The decision's fast paths give exactly what the general ones give: the per-row cache
bonus for a few matched rows against the vectorised one, the slot-based prefix match
against the by-id one, and in-place cost sums against plain ones."""

from __future__ import annotations

import random

import numpy as np

from hpcserve.contracts import protocol as p
from hpcserve.router.policies.base import Cached, RouteContext, RouteRequest, dense_cost
from hpcserve.router.policies.scorers import NewPrefill
from hpcserve.router.prefix_index import PrefixIndex
from hpcserve.router.registry import Registry


def random_table(rng: random.Random, n: int):
    reg = Registry(lease_s=60)
    for i in range(n):
        reg.register(p.Register(f"r{i}", "m", "u"), 0.0)
        reg.heartbeat(f"r{i}", p.ReplicaLoad(waiting=rng.randrange(12)), 0.0)
    table = reg.table("m")
    for _ in range(rng.randrange(60)):
        table.note_routed(rng.randrange(n))
    return table


def test_new_prefill_bonus_row_by_row_equals_the_vectorised_bonus() -> None:
    rng = random.Random(7)
    for trial in range(60):
        n = rng.choice([1, 2, 3, 8, 40])
        table = random_table(rng, n)
        rows = sorted(rng.sample(range(n), rng.randint(1, n)))
        cached = Cached(np.array(rows), np.array([rng.randrange(4000) for _ in rows]))
        ctx = RouteContext(RouteRequest("m", prompt_tokens=rng.randrange(3000)), table, cached)
        scorer = NewPrefill(rng.randrange(6), rng.choice([1.0, 1.5, 2.0]), rng.random())
        fast = dense_cost(scorer.cost(ctx), n)
        scorer.FEW_ROWS = -1  # the vectorised path
        assert np.array_equal(fast, dense_cost(scorer.cost(ctx), n)), trial


def test_match_by_slot_agrees_with_match_by_replica() -> None:
    index = PrefixIndex()
    rng = random.Random(3)
    chains = [[rng.randrange(1 << 60) for _ in range(12)] for _ in range(6)]
    for r in range(10):
        slot = index.slot(f"r{r}")
        chain = chains[r % 6]
        index.add_hashes(slot, chain[: rng.randint(1, 12)])
    for chain in chains:
        slots, depths = index.match_slots(chain)
        by_id = {index.replica_of(s): d for s, d in zip(slots, depths, strict=True)}
        assert by_id == index.match(chain)


def test_total_cost_in_place_equals_the_weighted_sum_and_leaves_the_table_alone() -> None:
    from hpcserve.router.policies.base import LowestCost, Policy, Weighted
    from hpcserve.router.policies.scorers import InFlight, KvPressure, Load

    rng = random.Random(5)
    table = random_table(rng, 20)
    load_before = table.load.copy()
    cached = Cached(np.array([2, 9]), np.array([512, 64]))
    ctx = RouteContext(RouteRequest("m", prompt_tokens=1024), table, cached)
    scorers = [
        Weighted(NewPrefill(), 1.0),
        Weighted(Load(512.0), 1.0),
        Weighted(KvPressure(), 0.5),
        Weighted(InFlight(), 0.0),
    ]
    total = Policy("t", [], scorers, LowestCost()).total_cost(ctx)
    expected = sum(w.weight * dense_cost(w.scorer.cost(ctx), 20) for w in scorers)
    assert np.allclose(total, expected)
    assert np.array_equal(table.load, load_before)
    cold = RouteContext(RouteRequest("m", prompt_tokens=100), table, None)
    only_prefill = Policy("t", [], [Weighted(NewPrefill(), 2.0)], LowestCost())
    assert only_prefill.total_cost(cold).tolist() == [200.0] * 20


def test_kept_floor_share_and_capacity_count_equal_a_rescan() -> None:
    """ReplicaTable keeps the least load, the shares (as raw x scale) with their sum, and
    the number of rows with a KV capacity between changes; each equals a full rescan after
    any mix of routes, releases, heartbeats, registrations and removals."""
    rng = random.Random(11)
    reg = Registry(lease_s=60)
    reference: dict[str, float] = {}  # replica id -> its share, decayed the plain way
    for step in range(3000):
        ids = [r.replica_id for r in reg.for_model("m")]
        action = rng.random()
        if action < 0.05 or len(ids) < 3:
            rid = f"r{step}"
            reg.register(p.Register(rid, "m", "u"), 0.0)
            reference[rid] = 0.0
        elif action < 0.08:
            rid = rng.choice(ids)
            reg.deregister(rid, "test")
            del reference[rid]
        elif action < 0.2:
            load = p.ReplicaLoad(waiting=rng.randrange(3), kv_capacity_tokens=rng.choice([0, 99]))
            reg.heartbeat(rng.choice(ids), load, 0.0)
        elif action < 0.6:
            replica = reg.get(rng.choice(ids))
            reg.routed(replica, 10)
            table = reg.table("m")
            step_size = 1.0 / table.share_window()
            for rid in reference:
                reference[rid] *= 1.0 - step_size
            reference[replica.replica_id] += step_size
            table.note_routed(replica.row)
        else:
            reg.released(rng.choice(ids))
        table = reg.table("m")
        assert table.load_floor() == table.load.min(), step
        assert table.kv_capacity_rows == int((table.kv_capacity > 0).sum()), step
        shares = {r.replica_id: table.recent_share[r.row] for r in table.replicas}
        assert np.allclose(list(shares.values()), [reference[k] for k in shares]), step
        assert np.isclose(table.share_total, sum(reference.values())), step


def test_shares_survive_folding_the_scale_back_in() -> None:
    table = random_table(random.Random(2), 3)
    for i in range(10_000):  # (31/32)^7,300 < 1e-100: the scale is folded in at least once
        table.note_routed(i % 3 if i % 5 else 0)
    assert table.share_scale > 1e-100
    assert np.isclose(table.recent_share.sum(), table.share_total)
    assert np.allclose(table.recent_share, [0.2 + 0.8 / 3, 0.8 / 3, 0.8 / 3], atol=0.05)


def test_routed_and_cached_prompt_tokens_are_counters_and_follow_the_replicas() -> None:
    from prometheus_client import CollectorRegistry

    from hpcserve.config import RoutingConfig
    from hpcserve.contracts import kv_wire as kw
    from hpcserve.contracts.prefix_hash import prompt_block_hashes
    from hpcserve.router.decide import Decider

    reg, prom, index = Registry(lease_s=60), CollectorRegistry(), PrefixIndex()
    decider = Decider(RoutingConfig(), reg, index=index, metrics_registry=prom)
    reg.on_add.append(decider.replica_added)
    reg.on_remove.append(decider.replica_removed)
    for rid in ("r0", "r1", "r2"):
        reg.register(p.Register(rid, "m", "u", block_size=16), 0.0)
    tokens = list(range(128))
    index.apply("r1", [kw.BlockStored([b"a", b"b", b"c", b"d"], None, tokens[:64], 16)])
    hashes = prompt_block_hashes(tokens, 16)
    msg = p.Route(1, "m", block_hashes=hashes, block_size=16, prompt_tokens=128)
    table = reg.table("m")
    cached = decider.cached_tokens(decider.request_of(msg, "m"), table)
    assert cached is not None and cached.at(reg.get("r1").row) == 64
    assert decider.pick(msg, 0.0).replica_id == "r1"
    counters = ("hpcserve_router_prompt_tokens_total", "hpcserve_router_cached_prompt_tokens_total")
    assert [prom.get_sample_value(c, {"model": "m"}) for c in counters] == [128.0, 64.0]
    # A replica that leaves takes its slot's blocks along; one registering anew starts cold.
    reg.deregister("r1", "test")
    assert decider.cached_tokens(decider.request_of(msg, "m"), table) is None
    reg.register(p.Register("r1", "m", "u", block_size=16), 0.0)
    assert decider.cached_tokens(decider.request_of(msg, "m"), reg.table("m")) is None


def test_cached_tokens_follow_a_slot_the_index_gave_to_another_replica() -> None:
    # A KV stream that is unwatched drops its replica's slot; the approximate mode (or a
    # re-watch) then takes a free slot, perhaps another replica's old one. Found on the
    # 64-replica simulated fleet, whose replicas shared one KV topic.
    from hpcserve.config import RoutingConfig
    from hpcserve.contracts.prefix_hash import prompt_block_hashes
    from hpcserve.router.decide import Decider

    reg, index = Registry(lease_s=60), PrefixIndex()
    decider = Decider(RoutingConfig(), reg, index=index)
    reg.on_add.append(decider.replica_added)
    reg.on_remove.append(decider.replica_removed)
    for rid in ("r0", "r1", "r2"):
        reg.register(p.Register(rid, "m", "u", block_size=16), 0.0)
    index.drop("r0")
    index.drop("r1")
    slot = index.slot("r1")  # r0's old slot
    assert index.replica_of(slot) == "r1"
    tokens = list(range(64))
    hashes = prompt_block_hashes(tokens, 16)
    index.add_hashes(slot, hashes)
    msg = p.Route(1, "m", block_hashes=hashes, block_size=16, prompt_tokens=64)
    cached = decider.cached_tokens(decider.request_of(msg, "m"), reg.table("m"))
    assert cached is not None
    assert list(cached.rows) == [reg.get("r1").row] and list(cached.tokens) == [64]
    assert decider.pick(msg, 0.0).replica_id == "r1"
