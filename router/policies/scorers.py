"""Cost scorers, in prompt-token units (lower is better).

- NewPrefill: prompt tokens this replica would have to compute (the prompt less its cached
  prefix). Over the overload gate a replica gets no cache bonus: affinity never outweighs
  a queue (the hot-spot bug of cache-aware routers). Over the share gate neither: in a
  fleet of n >= 3, a replica that took more than min(`max_share`, `share_factor` / n) of
  the model's recent requests loses its bonus, so one shared prompt spreads even at low
  concurrency, where no queue ever forms and the overload gate never fires; the limit
  scales with the fleet (3 to 20 replicas: 40%; 64: 12.5%, 8x the fair share). A match
  shorter than `min_prefix_tokens` earns no bonus either: one block of a template header
  that every prompt shares would otherwise draw each new customer's full prefill to the
  replicas already holding customers, whose own hits then wait behind it.
- Load: requests on the replica (routed and unreleased + the engine's waiting queue), in
  the token-equivalent `tokens_per_request`: Dynamo's decode-load term.
- KvPressure: the prompt's new tokens times the replica's KV fill: the largest of what the
  engine reports (blocks in use by running requests), what the router has routed there
  but not released, and what its KV events say its cache holds (both over its KV
  capacity: what the engine reports, vLLM's num_gpu_blocks x block_size, else
  `kv_capacity_tokens`): new long contexts go where there is room instead of evicting
  another context that is still in use (placement by capacity).
- InFlight: routed, unreleased requests only (what the router knows first-hand).
"""

from __future__ import annotations

import numpy as np

from hpcserve.router.policies.base import Cached, RouteContext, Sparse
from hpcserve.router.replica_table import FEW_ROWS


class NewPrefill:
    name = "new-prefill"

    # Pseudo-requests at the fair share behind the recent-share estimate (in windows), so
    # the first requests of a run do not count as a 100% share.
    SHARE_PRIOR = 1.0

    def __init__(
        self,
        overload_abs: int = 4,
        overload_rel: float = 1.5,
        max_share: float = 0.4,
        share_factor: float = 8.0,
        min_prefix_tokens: int = 0,
    ) -> None:
        self.overload_abs = overload_abs
        self.overload_rel = overload_rel
        self.max_share = max_share
        self.share_factor = share_factor
        self.min_prefix_tokens = min_prefix_tokens

    def share_limit(self, n: int) -> float | None:
        """The share of recent requests past which a replica of n loses its cache bonus;
        None: no share gate (fewer than 3 replicas, or max_share 1)."""
        if n < 3 or self.max_share >= 1.0:
            return None
        return min(self.max_share, self.share_factor / n)

    def overloaded(self, ctx: RouteContext, rows: np.ndarray) -> np.ndarray:
        table = ctx.table
        floor = table.load_floor()
        mine = table.load[rows]
        gated = (mine > floor + self.overload_abs) & (mine > self.overload_rel * floor)
        n = len(table)
        limit = self.share_limit(n)
        if limit is not None:
            share = table.share_raw[rows] * table.share_scale
            estimate = (share + self.SHARE_PRIOR / n) / (table.share_total + self.SHARE_PRIOR)
            gated |= estimate > limit
        return gated

    def cost(self, ctx: RouteContext) -> float | Sparse:
        prompt = max(ctx.request.prompt_tokens, 0)
        cached = ctx.cached_tokens
        if cached is None:
            return float(prompt)
        # The prompt's prefill is the same on every row: only the bonus is per row.
        if len(cached.rows) <= self.FEW_ROWS:
            return self._bonus_few(ctx, cached, prompt)
        rows = np.asarray(cached.rows, np.intp)
        held = np.minimum(np.asarray(cached.tokens, np.int64), prompt)
        no_bonus = self.overloaded(ctx, rows) | (held < self.min_prefix_tokens)
        return Sparse(float(prompt), rows, -np.where(no_bonus, 0, held))

    FEW_ROWS = FEW_ROWS

    def _bonus_few(self, ctx: RouteContext, cached: Cached, prompt: int) -> Sparse:
        """`cost` for a few matched rows, row by row, with `overloaded`'s arithmetic."""
        table = ctx.table
        load, raw, scale = table.load, table.share_raw, table.share_scale
        floor, n = table.load_floor(), len(table)
        busy, busy_rel = floor + self.overload_abs, self.overload_rel * floor
        limit = self.share_limit(n)
        prior, total = self.SHARE_PRIOR / n, table.share_total + self.SHARE_PRIOR
        rows: list[int] = []
        delta: list[float] = []
        shortest = self.min_prefix_tokens
        for row, held in zip(cached.rows, cached.tokens, strict=True):
            if held < shortest:
                continue
            mine = float(load[row])
            if mine > busy and mine > busy_rel:
                continue
            if limit is not None and (float(raw[row]) * scale + prior) / total > limit:
                continue
            rows.append(row)
            delta.append(-min(held, prompt))
        return Sparse(float(prompt), rows, delta)


class Load:
    name = "load"

    def __init__(self, tokens_per_request: float = 64.0) -> None:
        self.tokens_per_request = tokens_per_request

    def cost(self, ctx: RouteContext) -> np.ndarray:
        return ctx.load * self.tokens_per_request

    def cost_few(self, ctx: RouteContext) -> list[float]:
        per_request = self.tokens_per_request
        return [load * per_request for load in ctx.table.load.tolist()]


class KvPressure:
    name = "kv-pressure"

    def __init__(self, capacity_tokens: int = 0) -> None:
        self.capacity_tokens = capacity_tokens

    def cost(self, ctx: RouteContext) -> np.ndarray:
        table = ctx.table
        fill = table.kv_fill
        if self.capacity_tokens or table.kv_capacity_rows:
            capacity = table.kv_capacity  # as the engines report it, else the configured one
            if self.capacity_tokens:
                capacity = np.where(capacity > 0, capacity, self.capacity_tokens)
            held = np.maximum(table.active_tokens, table.held_tokens)
            room = np.divide(held, capacity, out=np.zeros(len(held)), where=capacity > 0)
            fill = np.minimum(np.maximum(fill, room), 1.0)
        prompt = max(ctx.request.prompt_tokens, 0)
        cost: np.ndarray = fill * prompt
        cached = ctx.cached_tokens
        if cached is not None and len(cached.rows) <= FEW_ROWS:
            for row, held_tokens in zip(cached.rows, cached.tokens, strict=True):
                cost[row] -= float(fill[row]) * min(held_tokens, prompt)
        elif cached is not None:
            rows = np.asarray(cached.rows, np.intp)
            cost[rows] -= fill[rows] * np.minimum(np.asarray(cached.tokens), prompt)
        return cost

    def cost_few(self, ctx: RouteContext) -> list[float]:
        """`cost` row by row on Python floats (the same IEEE operations)."""
        table = ctx.table
        fill = table.kv_fill.tolist()
        if self.capacity_tokens or table.kv_capacity_rows:
            configured = self.capacity_tokens
            capacities = table.kv_capacity.tolist()
            for row, (capacity, active, held_tokens) in enumerate(
                zip(
                    capacities,
                    table.active_tokens.tolist(),
                    table.held_tokens.tolist(),
                    strict=True,
                )
            ):
                if configured and not capacity > 0:
                    capacity = configured
                held = max(float(active), held_tokens)
                room = held / capacity if capacity > 0 else 0.0
                fill[row] = min(max(fill[row], room), 1.0)
        prompt = max(ctx.request.prompt_tokens, 0)
        cost = [f * prompt for f in fill]
        cached = ctx.cached_tokens
        if cached is not None:
            for row, held_tokens in zip(cached.rows, cached.tokens, strict=True):
                cost[row] -= fill[row] * min(held_tokens, prompt)
        return cost


class InFlight:
    name = "in-flight"

    def cost(self, ctx: RouteContext) -> np.ndarray:
        return ctx.table.in_flight.astype(np.float64)
