"""Pool roles: batch work on the batch pool, interactive work off it.

A pool is "interactive" (the default) or "batch" (`pools[].role`; each replica says which in
its Register). Over one model's replicas, per request:

- batch priority: the batch-pool replicas, plus interactive replicas with clear headroom
  (nothing waiting there and fewer than `lend_below` requests on them; 0: never lent);
- interactive priority: the interactive replicas.

A "usable" replica is routable and not excluded (a retry's exclusions, an adapter's hosts).
When a request has no usable replica of its own role, it may use every replica: interactive
traffic goes to the batch pool rather than fail while its model has only batch replicas
left, and a batch request goes where BatchYields (filters.py) sends it, as in a fleet
without a batch pool. So a model without a batch pool pays nothing (`table.batch_rows`
is 0) and routes as before.

Failure mode: lending reads the load the router knows (requests it routed and not yet
released, plus the engine's queue at its last heartbeat), so a burst of interactive
requests can meet up to `lend_below` batch requests already running there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcserve.router.policies.base import RouteContext
from hpcserve.router.registry import Replica


def usable_rows(ctx: RouteContext) -> np.ndarray | None:
    """Rows routable and allowed for this request; None when that is every row."""
    usable = ctx.table.routable if ctx.table.unroutable else None
    if ctx.allowed is not None:
        usable = ctx.allowed if usable is None else usable & ctx.allowed
    return usable


def usable_batch_pool(ctx: RouteContext) -> bool:
    """The model has a batch-pool replica this request may use."""
    table = ctx.table
    if not table.batch_rows:
        return False
    usable = usable_rows(ctx)
    return True if usable is None else bool((table.batch_pool & usable).any())


class PoolRoles:
    name = "pool-roles"

    def __init__(self, lend_below: int = 0) -> None:
        self.lend_below = lend_below

    def keep(self, ctx: RouteContext) -> np.ndarray | None:
        table = ctx.table
        if not table.batch_rows:
            return None
        batch = table.batch_pool
        if ctx.request.priority == "batch":
            if not usable_batch_pool(ctx):
                return None
            if not self.lend_below:
                return batch
            return batch | ((table.waiting == 0) & (table.load < self.lend_below))
        interactive = ~batch
        usable = usable_rows(ctx)
        if usable is not None:
            interactive &= usable
        return interactive if interactive.any() else None


def role_replicas(replicas: Sequence[Replica], priority: str, lend_below: int = 0) -> list[Replica]:
    """The replicas (routable, of one model) a request of `priority` may use, by the rule
    above for lists of replicas instead of table rows: where LoRA adapter placement
    chooses (router/adapters.py) without a ReplicaTable. All of them when the model has no
    batch pool, or when the request's own role has none."""
    batch = [r for r in replicas if r.spec.role == "batch"]
    if not batch:
        return list(replicas)
    interactive = [r for r in replicas if r.spec.role != "batch"]
    if priority == "batch":
        lent = [r for r in interactive if not r.load.waiting and r.queued < lend_below]
        return batch + lent
    return interactive or list(replicas)
