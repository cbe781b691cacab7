"""The kv-aware policy's pick over a table of at most FEW_ROWS rows in one compiled call
(router/_few_rows.c): NewPrefill's cache bonus, Load, KvPressure, their weighted sum and
LowestCost's pick, where the Python path (Policy._sum_few and the scorers' cost_few, the
picker's pick_few) makes a dozen calls and lists for a request that goes to one of two
replicas. The Python path stays the definition; both pick the same row to the bit
(tests/unit/test_policy_few_rows.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcserve.contracts.compiled_extension import load_extension
from hpcserve.router.policies.base import LowestCost, RouteContext, Weighted
from hpcserve.router.policies.scorers import KvPressure, Load, NewPrefill

# router/_few_rows.c's FEW_ROWS_API_VERSION is 1.
_few_rows: Any = load_extension("hpcserve.router._few_rows", "router/_few_rows.c", 1)


class KvAwareFewRows:
    """Policy.pick's few-rows step for the kv-aware policy (build_policy's scorers and
    picker): the row, or None when `kept` keeps none."""

    def __init__(self, prefill: NewPrefill, load: Load, kv: Weighted, picker: LowestCost) -> None:
        assert isinstance(kv.scorer, KvPressure)
        self.prefill = prefill
        self.load = load
        self.kv = kv.scorer
        self.kv_weight = kv.weight
        self.picker = picker

    @classmethod
    def of(cls, scorers: list[Weighted], picker: object) -> KvAwareFewRows | None:
        """One for a policy of NewPrefill, Load and KvPressure (the first two at weight 1,
        as build_policy makes kv-aware) with LowestCost; None for any other."""
        if len(scorers) != 3 or not isinstance(picker, LowestCost):
            return None
        prefill, load, kv = scorers
        if not (
            isinstance(prefill.scorer, NewPrefill)
            and prefill.weight == 1.0
            and isinstance(load.scorer, Load)
            and load.weight == 1.0
            and isinstance(kv.scorer, KvPressure)
        ):
            return None
        return cls(prefill.scorer, load.scorer, kv, picker)

    def __call__(self, ctx: RouteContext, kept: np.ndarray | None) -> int | None:
        table = ctx.table
        n = len(table)
        if n == 0:
            return None
        prefill, cached = self.prefill, ctx.cached_tokens
        floor = table.load_floor()
        return _few_rows.kv_aware_pick(
            table.load,
            table.kv_fill,
            table.kv_capacity,
            table.active_tokens,
            table.held_tokens,
            table.share_raw,
            self.picker.noise(n),
            kept,
            None if cached is None else cached.rows,
            None if cached is None else cached.tokens,
            ctx.request.prompt_tokens,
            self.load.tokens_per_request,
            self.kv_weight,
            self.kv.capacity_tokens,
            bool(self.kv.capacity_tokens or table.kv_capacity_rows),
            floor + prefill.overload_abs,
            prefill.overload_rel * floor,
            prefill.share_limit(n),
            table.share_scale,
            prefill.SHARE_PRIOR / n,
            table.share_total + prefill.SHARE_PRIOR,
            prefill.min_prefix_tokens,
        )
