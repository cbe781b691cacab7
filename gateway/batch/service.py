"""What a gateway holds of the Batch API: the store and the runner, started and stopped
with the gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from hpcserve.config import BatchConfig
from hpcserve.gateway.batch.execute import GatewayExecutor
from hpcserve.gateway.batch.runner import BatchMetrics, BatchRunner
from hpcserve.gateway.batch.slots import ModelLoad, model_loads
from hpcserve.gateway.batch.store import BatchStore

if TYPE_CHECKING:
    from hpcserve.gateway.app import Gateway


class BatchService:
    def __init__(self, config: BatchConfig, root: Path) -> None:
        self.config = config
        self.root = root
        self._store: BatchStore | None = None
        self._runner: BatchRunner | None = None

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

        async def loads() -> dict[str, ModelLoad]:
            listing = await gateway.routing.models()
            return model_loads(listing.models, (await gateway.routing.replicas()).replicas)

        self._runner = BatchRunner(
            self._store,
            GatewayExecutor(gateway),
            self.config,
            tenants={t.name: t for t in gateway.config.tenants},
            metrics=BatchMetrics(gateway.metrics_registry),
            model_loads=loads,
            quota=gateway.quota,
        )
        await self._runner.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.close()
        if self._store is not None:
            self._store.close()
