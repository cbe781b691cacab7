"""What a gateway holds of the Batch API: the store and the runner, started and stopped
with the gateway. Whether this gateway's runner runs batches is `batch.runner`
(lock.py): "standby" until a `hpcserve batch-runner` process is up, "gateway" always
when the lock is free, "process" never (it only watches that someone does)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpcserve.config import BatchConfig
from hpcserve.gateway.batch.execute import RoutedExecutor
from hpcserve.gateway.batch.lock import LockRole, RunnerLock
from hpcserve.gateway.batch.runner import BatchMetrics, BatchRunner
from hpcserve.gateway.batch.slots import ModelLoad, model_loads
from hpcserve.gateway.batch.store import BatchStore
from hpcserve.gateway.usage_log import UsageLog

if TYPE_CHECKING:
    from hpcserve.gateway.app import Gateway
    from hpcserve.gateway.routing_client import Routing

GATEWAY_LOCK_ROLE: dict[str, LockRole] = {
    "standby": "standby",
    "gateway": "gateway",
    "process": "never",
}


def loads_from(routing: Routing) -> Callable[[], Awaitable[dict[str, ModelLoad]]]:
    """The runner's view of each model's replicas and queues, from the router."""

    async def loads() -> dict[str, ModelLoad]:
        listing = await routing.models()
        return model_loads(listing.models, (await routing.replicas()).replicas)

    return loads


class BatchService:
    def __init__(self, config: BatchConfig, root: Path) -> None:
        self.config = config
        self.root = root
        self._store: BatchStore | None = None
        self._runner: BatchRunner | None = None
        self._usage: UsageLog | None = None

    @property
    def store(self) -> BatchStore:
        assert self._store is not None, "BatchService.start() was not awaited"
        return self._store

    @property
    def runner(self) -> BatchRunner:
        assert self._runner is not None, "BatchService.start() was not awaited"
        return self._runner

    async def start(self, gateway: Gateway) -> None:
        self._store = await asyncio.to_thread(BatchStore, self.root)
        if gateway.config.usage_dir:
            self._usage = UsageLog(gateway.config.usage_dir, "batch")
        executor = RoutedExecutor(
            gateway.routing,
            gateway.relay,
            route_hints=gateway.route_hints,
            configured_models=gateway.configured_models,
            isolate_tenant_caches=gateway.config.isolate_tenant_caches,
        )
        self._runner = BatchRunner(
            self._store,
            executor,
            self.config,
            tenants={t.name: t for t in gateway.config.tenants},
            metrics=BatchMetrics(gateway.metrics_registry),
            model_loads=loads_from(gateway.routing),
            quota=gateway.quota,
            lock=RunnerLock(
                self._store.root, GATEWAY_LOCK_ROLE[self.config.runner], name="gateway"
            ),
            usage=self._usage,
        )
        await self._runner.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.close()
        if self._store is not None:
            self._store.close()
        if self._usage is not None:
            self._usage.close()
