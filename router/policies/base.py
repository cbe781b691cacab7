"""The routing pipeline: filters -> weighted cost scorers -> picker.

A request is scored against one model's ReplicaTable (numpy vectors, row = replica):
- a Filter returns a boolean keep-mask over rows, or None when it has nothing to drop
  (the common case, so a healthy fleet pays nothing for it);
- a Scorer returns a cost in prompt-token units (lower is better): a vector over rows (a
  new one: the policy sums into it), one number when it is the same for every row, or a
  `Sparse` cost (a number or vector plus deltas on a few rows, e.g. a cache bonus); the
  policy sums them with their weights;
- the Picker takes the lowest total among kept rows, at random among exact ties, so
  equally cold, equally loaded replicas share the traffic.

Costs rather than [0, 1] scores because the default is Dynamo's form, new prefill tokens
plus decode load, whose terms must be in one unit to add up.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hpcserve.router.registry import Replica
from hpcserve.router.replica_table import FEW_ROWS, ReplicaTable


@dataclass
class RouteRequest:
    model: str
    block_hashes: Sequence[int] = ()
    block_size: int = 0
    prompt_tokens: int = 0
    # block_hashes samples every hash_stride-th of the prompt's hashed_blocks full blocks
    # (protocol.Route.hash_stride): n leading hashes held are min(n x stride, hashed) blocks.
    hash_stride: int = 1
    hashed_blocks: int = 0
    adapter: str = ""
    priority: str = "interactive"
    session_key: str = ""
    # "prefill": the prefill step of a disaggregated request (policies/pd_roles.py); "": any
    # other pick.
    phase: str = ""

    def __post_init__(self) -> None:
        if not self.hashed_blocks:
            self.hashed_blocks = len(self.block_hashes) * self.hash_stride


@dataclass
class Cached:
    """Prompt tokens cached per row, sparse: only the few rows the prefix index matched
    (lists, or numpy arrays)."""

    rows: Sequence[int]  # row indexes, each once
    tokens: Sequence[int]  # cached prompt tokens of each

    @classmethod
    def from_dense(cls, tokens: Sequence[int] | np.ndarray) -> Cached:
        dense = np.asarray(tokens, np.int64)
        rows = np.flatnonzero(dense)
        return cls(rows.tolist(), dense[rows].tolist())

    def dense(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.int64)
        out[np.asarray(self.rows, np.intp)] = self.tokens
        return out

    def at(self, row: int) -> int:
        for r, held in zip(self.rows, self.tokens, strict=True):
            if r == row:
                return int(held)
        return 0


@dataclass
class Sparse:
    """A cost of `base` (a number, or a new vector) on every row, plus `delta[i]` on row
    `rows[i]` (each row once): e.g. a prompt's prefill less the cache bonus of the few
    replicas that hold part of it, without a vector for the prompt."""

    base: float | np.ndarray
    rows: Sequence[int] | np.ndarray
    delta: Sequence[float] | np.ndarray

    def dense(self, n: int) -> np.ndarray:
        return dense_cost(self, n)


def dense_cost(cost: np.ndarray | float | Sparse, n: int) -> np.ndarray:
    """Any scorer's cost as a new vector over n rows."""
    if isinstance(cost, Sparse):
        out = dense_cost(cost.base, n)
        out[np.asarray(cost.rows, np.intp)] += np.asarray(cost.delta, np.float64)
        return out
    if isinstance(cost, np.ndarray):
        return cost.astype(np.float64)
    return np.full(n, float(cost))


@dataclass
class RouteContext:
    request: RouteRequest
    table: ReplicaTable
    # Cached prompt tokens, from the prefix index; None when nothing matched.
    cached_tokens: Cached | None = None
    # Rows the caller allows (None: all), e.g. a LoRA adapter's hosts.
    allowed: np.ndarray | None = None

    @property
    def load(self) -> np.ndarray:
        """Requests on each replica: routed and unreleased, plus the engine's own queue."""
        return self.table.load


class Filter(Protocol):
    name: str

    def keep(self, ctx: RouteContext) -> np.ndarray | None: ...


class Scorer(Protocol):
    name: str

    def cost(self, ctx: RouteContext) -> np.ndarray | float | Sparse:
        """Per-row cost (a new vector), one number when it is the same for every row, or
        a Sparse cost."""
        ...


class FewRowsScorer(Scorer, Protocol):
    def cost_few(self, ctx: RouteContext) -> list[float] | float | Sparse:
        """`cost` for a table of at most FEW_ROWS rows, a vector as Python floats from the
        same operations in the same order (the same IEEE results), with no numpy call per
        step: on a core whose caches went cold between requests, numpy's dispatch costs
        several times the arithmetic."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, ctx: RouteContext, total: np.ndarray, kept: np.ndarray | None) -> int | None:
        """The chosen row, or None when no row is kept."""
        ...

    def pick_few(
        self, ctx: RouteContext, total: list[float], kept: np.ndarray | None
    ) -> int | None:
        """`pick` for a table of at most FEW_ROWS rows, the total as Python floats: the
        same row `pick` chooses for the same total."""
        ...


class LowestCost:
    """The lowest total among kept rows; exact ties broken at random.

    Ties are broken by adding one of JITTERS pre-drawn vectors of noise far below one
    token (cycled), then one argmin: two vector operations instead of three.
    """

    name = "lowest-cost"
    JITTERS = 64

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._np_rng = np.random.default_rng(self._rng.getrandbits(64))
        self._jitter: list[np.ndarray] = []
        self._jitter_lists: list[list[float]] = []
        self._turn = 0

    def noise(self, n: int) -> np.ndarray:
        """The next request's tie-breaking noise over n rows."""
        if not self._jitter or len(self._jitter[0]) != n:
            self._jitter = [self._np_rng.random(n) * 1e-6 for _ in range(self.JITTERS)]
            self._jitter_lists = [v.tolist() for v in self._jitter]
        self._turn = (self._turn + 1) % self.JITTERS
        return self._jitter[self._turn]

    def pick_few(
        self, ctx: RouteContext, total: list[float], kept: np.ndarray | None
    ) -> int | None:
        n = len(total)
        if n == 0:
            return None
        self.noise(n)
        noise = self._jitter_lists[self._turn]
        keep = kept.tolist() if kept is not None else None
        best: int | None = None
        best_cost = 0.0
        for row in range(n):
            if keep is not None and not keep[row]:
                continue
            cost = total[row] + noise[row]
            if best is None or cost < best_cost:  # the first of equal lowest, as argmin
                best, best_cost = row, cost
        return best

    def pick(self, ctx: RouteContext, total: np.ndarray, kept: np.ndarray | None) -> int | None:
        if len(total) == 0:
            return None
        if kept is not None:
            if not kept.any():
                return None
            total = np.where(kept, total, np.inf)
        return int((total + self.noise(len(total))).argmin())


class RoundRobin:
    """Baseline: the next kept row in turn, ignoring every cost."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, ctx: RouteContext, total: np.ndarray, kept: np.ndarray | None) -> int | None:
        n = len(ctx.table)
        start = self._next.get(ctx.request.model, 0)
        for step in range(n):
            row = (start + step) % n
            if kept is None or kept[row]:
                self._next[ctx.request.model] = row + 1
                return row
        return None

    def pick_few(
        self, ctx: RouteContext, total: list[float], kept: np.ndarray | None
    ) -> int | None:
        return self.pick(ctx, np.zeros(0), kept)


@dataclass
class Weighted:
    scorer: Scorer
    weight: float


class Policy:
    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[Weighted],
        picker: Picker,
        *,
        uses_prefix: bool = False,
        few_rows: Callable[[RouteContext, np.ndarray | None], int | None] | None = None,
    ) -> None:
        """few_rows: the scorers' sum and the picker's pick over at most FEW_ROWS rows in
        one step, the same row as `_sum_few` and `pick_few` (kv_aware_few.py)."""
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.uses_prefix = uses_prefix
        self.few_rows = few_rows

    def add_filter(self, f: Filter) -> None:
        """Plug a filter into the pipeline (e.g. adapter placement from another module)."""
        self.filters.append(f)

    def keep_mask(self, ctx: RouteContext) -> np.ndarray | None:
        kept: np.ndarray | None = ctx.allowed
        for f in self.filters:
            mask = f.keep(ctx)
            if mask is not None:
                kept = mask if kept is None else kept & mask
        return kept

    def total_cost(self, ctx: RouteContext) -> np.ndarray:
        total, same_for_all = self._sum(ctx)
        if total is None:
            return np.full(len(ctx.table), same_for_all)
        if same_for_all:
            total += same_for_all
        return total

    def _sum(self, ctx: RouteContext) -> tuple[np.ndarray | None, float]:
        """The weighted sum of the costs as (a new vector or None, a number to add to every
        row): a cost equal on every row is kept apart, since it cannot change the choice."""
        total: np.ndarray | None = None
        same_for_all = 0.0
        sparse: list[tuple[float, Sparse]] = []
        for w in self.scorers:
            weight = w.weight
            if not weight:
                continue
            cost = w.scorer.cost(ctx)
            if isinstance(cost, Sparse):
                sparse.append((weight, cost))
                cost = cost.base
            if not isinstance(cost, np.ndarray):
                same_for_all += weight * cost
            elif total is None:  # the scorer's new vector: summed into in place
                total = cost.astype(np.float64, copy=False) if weight == 1.0 else cost * weight
            elif weight == 1.0:
                total += cost
            else:
                total += weight * cost
        if sparse:
            if total is None:
                total = np.zeros(len(ctx.table))
            for weight, cost in sparse:
                if len(cost.rows) <= FEW_ROWS:
                    for row, delta in zip(cost.rows, cost.delta, strict=True):
                        total[row] += weight * delta
                else:
                    total[np.asarray(cost.rows, np.intp)] += weight * np.asarray(cost.delta)
        return total, same_for_all

    def _sum_few(self, ctx: RouteContext) -> list[float]:
        """`_sum`'s vector (the part equal on every row left out) as Python floats, for a
        table of at most FEW_ROWS rows: the same operations in the same order on each row,
        so the same IEEE results (tests/unit/test_policy_few_rows.py)."""
        n = len(ctx.table)
        total: list[float] | None = None
        sparse: list[tuple[float, Sparse]] = []
        for w in self.scorers:
            weight = w.weight
            if not weight:
                continue
            few = getattr(w.scorer, "cost_few", None)
            cost = few(ctx) if few is not None else w.scorer.cost(ctx)
            if isinstance(cost, Sparse):
                sparse.append((weight, cost))
                cost = cost.base
            if isinstance(cost, np.ndarray):
                cost = cost.tolist()
            if not isinstance(cost, list):
                continue
            if total is None:
                total = [float(v) for v in cost] if weight == 1.0 else [v * weight for v in cost]
            elif weight == 1.0:
                total = [t + v for t, v in zip(total, cost, strict=True)]
            else:
                total = [t + weight * v for t, v in zip(total, cost, strict=True)]
        if total is None:
            total = [0.0] * n
        for weight, cost in sparse:
            for row, delta in zip(cost.rows, cost.delta, strict=True):
                total[row] += weight * delta
        return total

    def pick(self, ctx: RouteContext) -> Replica | None:
        kept = self.keep_mask(ctx)
        if len(ctx.table) <= FEW_ROWS:
            row = self._pick_few(ctx, kept)
        else:
            total, _ = self._sum(ctx)
            if total is None:
                total = np.zeros(len(ctx.table))
            row = self.picker.pick(ctx, total, kept)
        return None if row is None else ctx.table.replicas[row]

    def _pick_few(self, ctx: RouteContext, kept: np.ndarray | None) -> int | None:
        if self.few_rows is not None:
            try:
                return self.few_rows(ctx, kept)
            except OverflowError:  # a peer's token counts past int64: Python's ints take them
                pass
        return self.picker.pick_few(ctx, self._sum_few(ctx), kept)
