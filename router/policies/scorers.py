"""Cost scorers, in prompt-token units (lower is better).

- NewPrefill: prompt tokens this replica would have to compute (the prompt less its cached
  prefix). Over the overload gate a replica gets no cache bonus: affinity never outweighs
  a queue (the hot-spot bug of cache-aware routers). Over the share gate neither: in a
  fleet of 3 or more, a replica that took more than `max_share` of the model's recent
  requests loses its bonus, so one shared prompt spreads even at low concurrency, where
  no queue ever forms and the overload gate never fires.
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

from hpcserve.router.policies.base import RouteContext


class NewPrefill:
    name = "new-prefill"

    # Pseudo-requests at the fair share behind the recent-share estimate (in windows), so
    # the first requests of a run do not count as a 100% share.
    SHARE_PRIOR = 1.0

    def __init__(
        self, overload_abs: int = 4, overload_rel: float = 1.5, max_share: float = 0.4
    ) -> None:
        self.overload_abs = overload_abs
        self.overload_rel = overload_rel
        self.max_share = max_share

    def overloaded(self, ctx: RouteContext, rows: np.ndarray) -> np.ndarray:
        load = ctx.load
        floor = load.min() if len(load) else 0
        mine = load[rows]
        gated = (mine > floor + self.overload_abs) & (mine > self.overload_rel * floor)
        n = len(ctx.table)
        if n >= 3 and self.max_share < 1.0:
            share = ctx.table.recent_share
            estimate = (share[rows] + self.SHARE_PRIOR / n) / (share.sum() + self.SHARE_PRIOR)
            gated |= estimate > self.max_share
        return gated

    def cost(self, ctx: RouteContext) -> np.ndarray | float:
        prompt = max(ctx.request.prompt_tokens, 0)
        cached = ctx.cached_tokens
        if cached is None:
            return float(prompt)
        # Dense work is one fill; the cache bonus touches only the matched rows.
        cost = np.full(len(ctx.table), float(prompt))
        if len(cached.rows) <= self.FEW_ROWS:
            self._bonus_few(ctx, cached.rows.tolist(), cached.tokens.tolist(), prompt, cost)
            return cost
        bonus = np.where(self.overloaded(ctx, cached.rows), 0, np.minimum(cached.tokens, prompt))
        cost[cached.rows] -= bonus
        return cost

    # Up to this many matched rows, the bonus is computed in plain Python: a dozen numpy
    # calls on arrays of a few elements cost more than the arithmetic (router_cost.py).
    FEW_ROWS = 32

    def _bonus_few(
        self, ctx: RouteContext, rows: list[int], tokens: list[int], prompt: int, cost: np.ndarray
    ) -> None:
        """`overloaded` and the bonus of `cost`, row by row, with the same arithmetic."""
        load = ctx.load
        floor = float(load.min()) if len(load) else 0.0
        n = len(ctx.table)
        share = ctx.table.recent_share if n >= 3 and self.max_share < 1.0 else None
        if share is not None:
            prior, total = self.SHARE_PRIOR / n, float(share.sum()) + self.SHARE_PRIOR
        for row, held in zip(rows, tokens, strict=True):
            mine = float(load[row])
            if mine > floor + self.overload_abs and mine > self.overload_rel * floor:
                continue
            if share is not None and (float(share[row]) + prior) / total > self.max_share:
                continue
            cost[row] = cost[row] - min(held, prompt)


class Load:
    name = "load"

    def __init__(self, tokens_per_request: float = 64.0) -> None:
        self.tokens_per_request = tokens_per_request

    def cost(self, ctx: RouteContext) -> np.ndarray:
        return ctx.load * self.tokens_per_request


class KvPressure:
    name = "kv-pressure"

    def __init__(self, capacity_tokens: int = 0) -> None:
        self.capacity_tokens = capacity_tokens

    def cost(self, ctx: RouteContext) -> np.ndarray:
        table = ctx.table
        fill = table.kv_fill
        capacity = table.kv_capacity  # as the engines report it, else the configured one
        if self.capacity_tokens:
            capacity = np.where(capacity > 0, capacity, self.capacity_tokens)
        if capacity.any():
            held = np.maximum(table.active_tokens, table.held_tokens)
            room = np.divide(held, capacity, out=np.zeros(len(held)), where=capacity > 0)
            fill = np.minimum(np.maximum(fill, room), 1.0)
        prompt = max(ctx.request.prompt_tokens, 0)
        cost = fill * prompt
        cached = ctx.cached_tokens
        if cached is not None:
            cost[cached.rows] -= fill[cached.rows] * np.minimum(cached.tokens, prompt)
        return cost


class InFlight:
    name = "in-flight"

    def cost(self, ctx: RouteContext) -> np.ndarray:
        return ctx.table.in_flight.astype(np.float64)
