"""In-flight batch requests per model, bounded: `per_replica` x the model's live replicas.

Waiters are served first come, first served, so several batches on one model take turns
line by line instead of the oldest batch holding every slot.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ModelSlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.used < self.capacity and not self._waiters:
            self.used += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release()  # granted just as the waiter gave up: hand it on
            raise

    def release(self) -> None:
        self.used -= 1
        self._grant()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used < self.capacity:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.used += 1
                waiter.set_result(None)


class PoolSlots:
    def __init__(self, per_replica: int) -> None:
        self.per_replica = per_replica
        self._models: dict[str, ModelSlots] = {}
        self._replicas: dict[str, int] = {}

    def for_model(self, model: str) -> ModelSlots:
        slots = self._models.get(model)
        if slots is None:
            slots = self._models[model] = ModelSlots(self._capacity(model))
        return slots

    def _capacity(self, model: str) -> int:
        # With no replica known, one replica's worth: they wait for one to come.
        return self.per_replica * max(1, self._replicas.get(model, 0))

    def set_replicas(self, replicas: dict[str, int]) -> None:
        self._replicas = dict(replicas)
        for model, slots in self._models.items():
            slots.resize(self._capacity(model))

    def in_flight(self) -> int:
        return sum(s.used for s in self._models.values())
