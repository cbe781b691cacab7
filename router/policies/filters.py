"""Filters: which replicas of the model may take this request at all."""

from __future__ import annotations

import numpy as np

from hpcserve.router.policies.base import RouteContext
from hpcserve.router.policies.pool_roles import usable_batch_pool


class Routable:
    """Drops replicas taken out of routing (unhealthy, draining); free when none are."""

    name = "routable"

    def keep(self, ctx: RouteContext) -> np.ndarray | None:
        return ctx.table.routable if ctx.table.unroutable else None


class ServesAdapter:
    """A request for a LoRA adapter goes only to replicas that have it loaded, when any do
    (else every replica stays: where to load it is the adapter placement's decision)."""

    name = "adapter"

    def keep(self, ctx: RouteContext) -> np.ndarray | None:
        adapter = ctx.request.adapter
        if not adapter:
            return None
        mask = np.fromiter(
            (adapter in r.spec.adapters for r in ctx.table.replicas), bool, len(ctx.table)
        )
        return mask if mask.any() else None


class BatchYields:
    """Priority: a batch request avoids replicas with interactive work queued, when an
    idle-queued replica exists, so batch never waits in front of interactive traffic.
    A model with a usable batch pool leaves batch placement to PoolRoles (pool_roles.py):
    queues there are batch work."""

    name = "batch-yields"

    def keep(self, ctx: RouteContext) -> np.ndarray | None:
        if ctx.request.priority != "batch" or usable_batch_pool(ctx):
            return None
        mask = ctx.table.waiting == 0
        return mask if mask.any() else None
