"""The decision's fast paths give exactly what the general ones give: the per-row cache
bonus for a few matched rows against the vectorised one, the slot-based prefix match
against the by-id one, and in-place cost sums against plain ones."""

from __future__ import annotations

import random

import numpy as np

from hpcserve.router import protocol as p
from hpcserve.router.policies.base import Cached, RouteContext, RouteRequest
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
        fast = scorer.cost(ctx)
        scorer.FEW_ROWS = -1  # the vectorised path
        assert np.array_equal(fast, scorer.cost(ctx)), trial


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
    expected = sum(w.weight * np.asarray(w.scorer.cost(ctx), np.float64) for w in scorers)
    assert np.allclose(total, expected)
    assert np.array_equal(table.load, load_before)
    cold = RouteContext(RouteRequest("m", prompt_tokens=100), table, None)
    only_prefill = Policy("t", [], [Weighted(NewPrefill(), 2.0)], LowestCost())
    assert only_prefill.total_cost(cold).tolist() == [200.0] * 20
