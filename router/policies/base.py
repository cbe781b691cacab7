"""The routing pipeline: filters -> weighted cost scorers -> picker.

A request is scored against one model's ReplicaTable (numpy vectors, row = replica):
- a Filter returns a boolean keep-mask over rows, or None when it has nothing to drop
  (the common case, so a healthy fleet pays nothing for it);
- a Scorer returns a cost vector in prompt-token units (lower is better); the policy sums
  them with their weights;
- the Picker takes the lowest total among kept rows, at random among exact ties, so
  equally cold, equally loaded replicas share the traffic.

Costs rather than [0, 1] scores because the default is Dynamo's form, new prefill tokens
plus decode load, whose terms must be in one unit to add up.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hpcserve.router.registry import Replica
from hpcserve.router.replica_table import ReplicaTable


@dataclass
class RouteRequest:
    model: str
    block_hashes: Sequence[int] = ()
    block_size: int = 0
    prompt_tokens: int = 0
    adapter: str = ""
    priority: str = "interactive"
    session_key: str = ""


@dataclass
class Cached:
    """Prompt tokens cached per row, sparse: only the few rows the prefix index matched."""

    rows: np.ndarray  # int row indexes
    tokens: np.ndarray  # cached prompt tokens of each

    @classmethod
    def from_dense(cls, tokens: Sequence[int] | np.ndarray) -> Cached:
        dense = np.asarray(tokens, np.int64)
        rows = np.flatnonzero(dense)
        return cls(rows, dense[rows])

    def dense(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.int64)
        out[self.rows] = self.tokens
        return out

    def at(self, row: int) -> int:
        rows = self.rows.tolist()  # a few rows: cheaper than three numpy calls
        return int(self.tokens[rows.index(row)]) if row in rows else 0


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

    def cost(self, ctx: RouteContext) -> np.ndarray | float:
        """Per-row cost, or one number when it is the same for every row."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, ctx: RouteContext, total: np.ndarray, kept: np.ndarray | None) -> int | None:
        """The chosen row, or None when no row is kept."""
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
        self._turn = 0

    def _noise(self, n: int) -> np.ndarray:
        if not self._jitter or len(self._jitter[0]) != n:
            self._jitter = [self._np_rng.random(n) * 1e-6 for _ in range(self.JITTERS)]
        self._turn = (self._turn + 1) % self.JITTERS
        return self._jitter[self._turn]

    def pick(self, ctx: RouteContext, total: np.ndarray, kept: np.ndarray | None) -> int | None:
        if len(total) == 0:
            return None
        if kept is not None:
            if not kept.any():
                return None
            total = np.where(kept, total, np.inf)
        return int((total + self._noise(len(total))).argmin())


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
    ) -> None:
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.uses_prefix = uses_prefix

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
        # One fresh vector accumulated in place; costs equal on every row add up as a number.
        total: np.ndarray | None = None
        same_for_all = 0.0
        for w in self.scorers:
            if not w.weight:
                continue
            cost = w.scorer.cost(ctx)
            if not isinstance(cost, np.ndarray):
                same_for_all += w.weight * cost
            elif total is None:
                total = cost * w.weight if w.weight != 1.0 else cost.astype(np.float64)
            elif w.weight == 1.0:
                total += cost
            else:
                total += w.weight * cost
        if total is None:
            return np.full(len(ctx.table), same_for_all)
        if same_for_all:
            total += same_for_all
        return total

    def pick(self, ctx: RouteContext) -> Replica | None:
        kept = self.keep_mask(ctx)
        row = self.picker.pick(ctx, self.total_cost(ctx), kept)
        return None if row is None else ctx.table.replicas[row]
