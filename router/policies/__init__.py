"""Routing policies: filters -> weighted cost scorers -> picker (base.py), by config name."""

from __future__ import annotations

import random

from hpcserve.config import RoutingConfig
from hpcserve.router.policies.base import Filter, LowestCost, Policy, RoundRobin, Weighted
from hpcserve.router.policies.filters import BatchYields, Routable, ServesAdapter
from hpcserve.router.policies.kv_aware_few import KvAwareFewRows
from hpcserve.router.policies.pd_roles import PdRoles
from hpcserve.router.policies.pool_roles import PoolRoles
from hpcserve.router.policies.scorers import KvPressure, Load, NewPrefill


def build_policy(config: RoutingConfig, rng: random.Random | None = None) -> Policy:
    filters: list[Filter] = [
        Routable(),
        ServesAdapter(),
        PoolRoles(config.batch_lend_below),
        BatchYields(),
        PdRoles(),
    ]
    if config.policy == "round-robin":
        return Policy("round-robin", filters, [], RoundRobin())
    if config.policy == "least-load":
        return Policy("least-load", filters, [Weighted(Load(1.0), 1.0)], LowestCost(rng))
    scorers = [
        Weighted(
            NewPrefill(
                config.overload_abs,
                config.overload_rel,
                config.max_share,
                config.share_factor,
                config.min_prefix_tokens,
            ),
            1.0,
        ),
        Weighted(Load(config.tokens_per_request), 1.0),
        Weighted(KvPressure(config.kv_capacity_tokens), config.kv_pressure_weight),
    ]
    picker = LowestCost(rng)
    return Policy(
        "kv-aware",
        filters,
        scorers,
        picker,
        uses_prefix=True,
        few_rows=KvAwareFewRows.of(scorers, picker),
    )
