"""The policy's path for tables of at most FEW_ROWS replicas (Python floats, no numpy call per
step) against its numpy path, on random tables: the same scorer costs and totals to the bit
and the same row picked, for every policy, load, KV fill and capacity, share, cache match and
filter; and the kv-aware policy's compiled pick (router/policies/kv_aware_few.py) against
both."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hpcserve.config import RoutingConfig
from hpcserve.contracts import protocol as p
from hpcserve.router.policies import build_policy
from hpcserve.router.policies.base import (
    Cached,
    RouteContext,
    RouteRequest,
    Weighted,
    dense_cost,
)
from hpcserve.router.policies.kv_aware_few import KvAwareFewRows
from hpcserve.router.registry import Registry
from hpcserve.router.replica_table import FEW_ROWS


def random_context(rng: random.Random, n: int) -> RouteContext:
    registry = Registry(lease_s=1e9)
    for i in range(n):
        registry.register(p.Register(f"r{i}", "m", f"http://r{i}", block_size=16), now=0.0)
        registry.heartbeat(
            f"r{i}",
            p.ReplicaLoad(
                running=rng.randrange(8),
                waiting=rng.choice([0, 0, 0, rng.randrange(10)]),
                kv_usage=rng.random() * 1.2,
                kv_capacity_tokens=rng.choice([0, rng.randrange(1, 200_000)]),
            ),
            now=0.0,
        )
    table = registry.table("m")
    assert table is not None and len(table) == n
    for replica in table.replicas:  # requests in flight, and a recent share
        for _ in range(rng.randrange(6)):
            registry.routed(replica, rng.randrange(4000))
            table.note_routed(replica.row)
    table.held_tokens[:] = [rng.randrange(100_000) for _ in range(n)]
    prompt = rng.randrange(1, 8000)
    matched = rng.sample(range(n), rng.randrange(n + 1))
    cached = Cached(matched, [rng.randrange(prompt + 200) for _ in matched]) if matched else None
    allowed = None
    if rng.random() < 0.3:
        allowed = np.array([rng.random() < 0.6 for _ in range(n)], bool)
    request = RouteRequest("m", block_size=16, prompt_tokens=prompt)
    return RouteContext(request, table, cached, allowed)


@pytest.mark.parametrize("policy", ["kv-aware", "least-load", "round-robin"])
@pytest.mark.parametrize("seed", range(6))
def test_the_few_rows_path_costs_sums_and_picks_as_the_numpy_path(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    config = RoutingConfig(
        policy=policy,
        kv_capacity_tokens=rng.choice([0, 50_000]),
        kv_pressure_weight=rng.choice([0.0, 0.5, 1.0, 2.0]),
        min_prefix_tokens=rng.choice([0, 64]),
    )
    built = build_policy(config, random.Random(seed))
    for _ in range(60):
        n = rng.randrange(1, FEW_ROWS + 1)
        ctx = random_context(rng, n)
        for weighted in built.scorers:
            few = getattr(weighted.scorer, "cost_few", None)
            if few is not None:
                few_cost = few(ctx)
                few_dense = few_cost if isinstance(few_cost, list) else dense_cost(few_cost, n)
                assert list(few_dense) == dense_cost(weighted.scorer.cost(ctx), n).tolist()
        vector, _ = built._sum(ctx)
        numpy_total = vector.tolist() if vector is not None else [0.0] * n
        few_total = built._sum_few(ctx)
        assert few_total == numpy_total  # bit for bit: the same operations in the same order
        kept = built.keep_mask(ctx)
        picker = built.picker
        turn = getattr(picker, "_turn", 0)
        by_numpy = picker.pick(ctx, np.asarray(numpy_total), kept)
        if hasattr(picker, "_turn"):
            picker._turn = turn  # the same tie-breaking noise for both
        if hasattr(picker, "_next"):
            picker._next.clear()
        by_few = picker.pick_few(ctx, few_total, kept)
        if hasattr(picker, "_next"):
            picker._next.clear()
        assert by_few == by_numpy
        if built.few_rows is not None:  # kv-aware: compiled (router/_few_rows.c)
            picker._turn = turn  # type: ignore[attr-defined]
            assert built.few_rows(ctx, kept) == by_few


def test_ties_go_to_the_same_row_and_nothing_kept_picks_nothing() -> None:
    built = build_policy(RoutingConfig(policy="least-load"), random.Random(1))
    ctx = random_context(random.Random(2), 4)
    picker = built.picker
    for turn in range(picker.JITTERS):  # type: ignore[attr-defined]
        picker._turn = turn  # type: ignore[attr-defined]
        by_numpy = picker.pick(ctx, np.zeros(4), None)
        picker._turn = turn  # type: ignore[attr-defined]
        assert picker.pick_few(ctx, [0.0] * 4, None) == by_numpy
    assert picker.pick_few(ctx, [1.0] * 4, np.zeros(4, bool)) is None


def test_the_compiled_pick_breaks_ties_and_keeps_rows_as_the_python_path() -> None:
    """Equal totals (every row idle, nothing cached): the noise decides, the same way; a
    kept mask that keeps none picks none; every turn of the noise, every kept subset."""
    built = build_policy(RoutingConfig(), random.Random(3))
    assert built.few_rows is not None
    rng = random.Random(4)
    registry = Registry(lease_s=1e9)
    for i in range(5):
        registry.register(p.Register(f"r{i}", "m", f"http://r{i}", block_size=16), now=0.0)
    table = registry.table("m")
    assert table is not None
    picker = built.picker
    for turn in range(picker.JITTERS):  # type: ignore[attr-defined]
        kept = np.array([rng.random() < 0.5 for _ in range(5)], bool)
        for mask in (None, kept, np.zeros(5, bool)):
            ctx = RouteContext(RouteRequest("m", block_size=16, prompt_tokens=100), table)
            picker._turn = turn  # type: ignore[attr-defined]
            expected = picker.pick_few(ctx, built._sum_few(ctx), mask)
            picker._turn = turn  # type: ignore[attr-defined]
            assert built.few_rows(ctx, mask) == expected
    picker._turn = 0  # type: ignore[attr-defined]
    assert built.few_rows(ctx, np.zeros(5, bool)) is None


def test_only_the_kv_aware_composition_is_compiled() -> None:
    assert build_policy(RoutingConfig(policy="least-load")).few_rows is None
    assert build_policy(RoutingConfig(policy="round-robin")).few_rows is None
    kv_aware = build_policy(RoutingConfig())
    assert kv_aware.few_rows is not None
    assert KvAwareFewRows.of(kv_aware.scorers[:2], kv_aware.picker) is None
    heavier = [Weighted(w.scorer, 2.0) for w in kv_aware.scorers]
    assert KvAwareFewRows.of(heavier, kv_aware.picker) is None  # NewPrefill and Load at 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"load": np.zeros(3, np.int64)}, "load: expected a vector of 3 float64"),
        ({"active_tokens": np.zeros(3)}, "active_tokens: expected a vector of 3 int64"),
        ({"noise": np.zeros(2)}, "noise: expected a vector of 3 float64"),
        ({"cached_rows": [0, 5], "cached_tokens": [1, 2]}, "cached_rows: row 5 of 3"),
        ({"cached_rows": [0], "cached_tokens": [1, 2]}, "differ in length"),
    ],
)
def test_the_compiled_pick_refuses_vectors_it_cannot_read(
    change: dict[str, object], message: str
) -> None:
    from hpcserve.router.policies.kv_aware_few import _few_rows

    vectors: dict[str, object] = {
        "load": np.zeros(3), "kv_fill": np.zeros(3), "kv_capacity": np.zeros(3),
        "active_tokens": np.zeros(3, np.int64), "held_tokens": np.zeros(3),
        "share_raw": np.zeros(3), "noise": np.zeros(3), "kept": None,
        "cached_rows": None, "cached_tokens": None,
    }  # fmt: skip
    vectors.update(change)
    with pytest.raises((TypeError, ValueError, IndexError), match=message):
        _few_rows.kv_aware_pick(
            *vectors.values(), 100, 64.0, 1.0, 0, False, 4.0, 0.0, None, 1.0, 0.5, 1.0, 0
        )


def test_token_counts_past_int64_take_the_python_path() -> None:
    """A peer's Route may say more tokens than int64 holds (msgspec reads up to 2**64 - 1):
    the compiled pick cannot take them, the Python path picks as it always did."""
    built = build_policy(RoutingConfig(), random.Random(5))
    ctx = random_context(random.Random(6), 4)
    ctx.request.prompt_tokens = 2**64 - 1
    picker = built.picker
    turn = picker._turn  # type: ignore[attr-defined]
    expected = picker.pick_few(ctx, built._sum_few(ctx), built.keep_mask(ctx))
    picker._turn = turn - 1  # type: ignore[attr-defined]  # the compiled try draws one turn
    chosen = built.pick(ctx)
    assert chosen is not None and chosen.row == expected
