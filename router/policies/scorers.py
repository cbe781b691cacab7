"""Cost scorers, in prompt-token units (lower is better).

- NewPrefill: prompt tokens this replica would have to compute (the prompt less its cached
  prefix). Over the overload gate a replica gets no cache bonus: affinity never outweighs
  a queue (the hot-spot bug of cache-aware routers).
- Load: requests on the replica (routed and unreleased + the engine's waiting queue), in
  the token-equivalent `tokens_per_request`: Dynamo's decode-load term.
- KvPressure: the prompt's new tokens times the replica's KV fill (the larger of what the
  engine reports and what the router has routed there but not released, over its
  capacity): new long contexts go where there is room instead of evicting a full cache.
- InFlight: routed, unreleased requests only (what the router knows first-hand).
"""

from __future__ import annotations

import numpy as np

from hpcserve.router.policies.base import RouteContext


class NewPrefill:
    name = "new-prefill"

    def __init__(self, overload_abs: int = 4, overload_rel: float = 1.5) -> None:
        self.overload_abs = overload_abs
        self.overload_rel = overload_rel

    def overloaded(self, ctx: RouteContext, rows: np.ndarray) -> np.ndarray:
        load = ctx.load
        floor = load.min() if len(load) else 0
        mine = load[rows]
        return (mine > floor + self.overload_abs) & (mine > self.overload_rel * floor)

    def cost(self, ctx: RouteContext) -> np.ndarray | float:
        prompt = max(ctx.request.prompt_tokens, 0)
        cached = ctx.cached_tokens
        if cached is None:
            return float(prompt)
        # Dense work is one fill; the cache bonus touches only the matched rows.
        bonus = np.where(self.overloaded(ctx, cached.rows), 0, np.minimum(cached.tokens, prompt))
        cost = np.full(len(ctx.table), float(prompt))
        cost[cached.rows] -= bonus
        return cost


class Load:
    name = "load"

    def __init__(self, tokens_per_request: float = 512.0) -> None:
        self.tokens_per_request = tokens_per_request

    def cost(self, ctx: RouteContext) -> np.ndarray:
        return ctx.load * self.tokens_per_request


class KvPressure:
    name = "kv-pressure"

    def __init__(self, capacity_tokens: int = 0) -> None:
        self.capacity_tokens = capacity_tokens

    def cost(self, ctx: RouteContext) -> np.ndarray:
        fill = ctx.table.kv_fill
        if self.capacity_tokens:
            fill = np.minimum(np.maximum(fill, ctx.table.active_tokens / self.capacity_tokens), 1.0)
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
