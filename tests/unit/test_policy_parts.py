"""Each filter, scorer and picker of router/policies on a hand-made ReplicaTable."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hpcserve.config import ConfigError, RoutingConfig, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.router.policies import build_policy
from hpcserve.router.policies.base import (
    Cached,
    LowestCost,
    RoundRobin,
    RouteContext,
    RouteRequest,
)
from hpcserve.router.policies.filters import BatchYields, Routable, ServesAdapter
from hpcserve.router.policies.scorers import InFlight, KvPressure, Load, NewPrefill
from hpcserve.router.registry import Registry


def table(loads, adapters=None, kv=None):
    reg = Registry(lease_s=60)
    for i, waiting in enumerate(loads):
        reg.register(
            p.Register(f"r{i}", "m", "u", adapters=(adapters or {}).get(i, [])),
            0.0,
        )
        reg.heartbeat(f"r{i}", p.ReplicaLoad(waiting=waiting, kv_usage=(kv or {}).get(i, 0.0)), 0)
    return reg, reg.table("m")


def ctx(t, **request):
    cached = request.pop("cached", None)
    return RouteContext(
        RouteRequest("m", **request), t, None if cached is None else Cached.from_dense(cached)
    )


def test_routable_filter_is_free_until_a_replica_leaves_routing():
    reg, t = table([0, 0])
    assert Routable().keep(ctx(t)) is None
    reg.set_routable("r1", False)
    assert Routable().keep(ctx(t)).tolist() == [True, False]
    reg.set_routable("r1", True)
    assert Routable().keep(ctx(t)) is None


def test_adapter_filter_keeps_replicas_with_the_adapter_loaded():
    _, t = table([0, 0, 0], adapters={1: ["sql"]})
    assert ServesAdapter().keep(ctx(t)) is None
    assert ServesAdapter().keep(ctx(t, adapter="sql")).tolist() == [False, True, False]
    assert ServesAdapter().keep(ctx(t, adapter="nowhere")) is None


def test_batch_yields_to_queued_interactive_work():
    _, t = table([2, 0, 1])
    assert BatchYields().keep(ctx(t)) is None
    assert BatchYields().keep(ctx(t, priority="batch")).tolist() == [False, True, False]
    _, busy = table([1, 1])
    assert BatchYields().keep(ctx(busy, priority="batch")) is None


def test_new_prefill_counts_uncached_tokens_and_the_overload_gate():
    _, t = table([0, 0, 10])
    scorer = NewPrefill(overload_abs=4, overload_rel=1.5)
    assert scorer.cost(ctx(t, prompt_tokens=1000)) == 1000.0
    cost = scorer.cost(ctx(t, prompt_tokens=1000, cached=[0, 512, 900]))
    assert cost.dense(3).tolist() == [1000.0, 488.0, 1000.0]  # r2 is overloaded: no bonus


def test_load_and_in_flight_costs():
    reg, t = table([1, 3])
    reg.routed(reg.get("r0"))
    assert Load(100.0).cost(ctx(t)).tolist() == [200.0, 300.0]
    assert InFlight().cost(ctx(t)).tolist() == [1.0, 0.0]


def test_kv_pressure_uses_reported_usage_or_routed_tokens():
    reg, t = table([0, 0], kv={0: 0.5})
    assert KvPressure().cost(ctx(t, prompt_tokens=100)).tolist() == [50.0, 0.0]
    reg.routed(reg.get("r1"), 800)
    cost = KvPressure(capacity_tokens=1000).cost(ctx(t, prompt_tokens=100, cached=[0, 50]))
    assert cost.tolist() == [50.0, 40.0]


def test_lowest_cost_breaks_exact_ties_at_random_and_respects_the_mask():
    _, t = table([0, 0, 0])
    picker = LowestCost(random.Random(3))
    picks = {picker.pick(ctx(t), np.array([1.0, 1.0, 2.0]), None) for _ in range(50)}
    assert picks == {0, 1}
    assert picker.pick(ctx(t), np.array([1.0, 5.0, 2.0]), np.array([False, True, True])) == 2
    assert picker.pick(ctx(t), np.array([1.0, 1.0, 1.0]), np.zeros(3, bool)) is None


def test_round_robin_skips_masked_rows():
    _, t = table([0, 0, 0])
    rr = RoundRobin()
    kept = np.array([True, False, True])
    assert [rr.pick(ctx(t), np.zeros(3), kept) for _ in range(4)] == [0, 2, 0, 2]


def test_policy_is_chosen_by_config_and_takes_extra_filters():
    assert build_policy(RoutingConfig()).name == "kv-aware"
    assert build_policy(RoutingConfig(policy="least-load")).name == "least-load"
    policy = build_policy(RoutingConfig(policy="round-robin"))

    class NoneLeft:
        name = "none-left"

        def keep(self, c):
            return np.zeros(len(c.table), bool)

    policy.add_filter(NoneLeft())
    _, t = table([0])
    assert policy.pick(ctx(t)) is None


def test_routing_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="policy"):
        parse_config({"router": {"routing": {"policy": "fastest"}}})
