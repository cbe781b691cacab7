"""Disaggregated prefill and decode: a model's prefill pool takes only prefill steps.

A prefill or decode pool (`pools[].role`, each replica says which in its Register) serves
its model in two steps (gateway/disagg.py): the prompt on a prefill replica, the decode on
a decode replica that loads the prompt's KV cache through vLLM's KV-transfer connector. The
router picks both for one Route (server.py): the prefill replica by prefix-cache overlap and
queue (the policy's scorers over the prefill rows), then the decode replica by KV headroom
and load over the other rows, same node as the prefill first, then the same leaf switch
(`near_tier`; the pool manager tells the router each node's leaf switch, ListReplicas).

So ordinary picks (phase "") keep off the prefill rows, and a prefill pick (phase "prefill")
keeps to them. When no other replica is usable, an ordinary pick may use a prefill replica:
its engine serves a request whole (its connector only stores the KV on the side), which
beats failing the request. A model without a prefill pool pays one attribute read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from hpcserve.router.policies.base import RouteContext
from hpcserve.router.policies.pool_roles import usable_rows

PREFILL = "prefill"
T = TypeVar("T")


def near_tier(
    tiers: Sequence[tuple[str, Sequence[T]]],
    load: Callable[[T], float],
    floor: float,
    overload_abs: float,
) -> tuple[str, Sequence[T]] | None:
    """The decode replica's locality (pure): the first of `tiers` (nearest first: the
    prefill's node, then its leaf switch; each tier's candidates) whose least loaded
    candidate is within `overload_abs` of `floor`, the least load of any replica of the
    model; None: no tier qualifies (the pick is over every candidate). So locality decides
    between replicas about as loaded as the least loaded one, and never sends a decode to
    an overloaded replica because it is near."""
    for name, members in tiers:
        if members and min(load(m) for m in members) <= floor + overload_abs:
            return name, members
    return None


class PdRoles:
    name = "pd-roles"

    def keep(self, ctx: RouteContext) -> np.ndarray | None:
        table = ctx.table
        if not table.prefill_rows:
            return None
        prefill = table.prefill_pool
        usable = usable_rows(ctx)
        if ctx.request.phase == PREFILL:
            return prefill if usable is None else prefill & usable
        others = ~prefill
        if usable is not None:
            others &= usable
        return others if others.any() else None
