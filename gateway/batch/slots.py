"""In-flight batch requests per model, bounded: a bound per replica x the model's live
replicas. The bound per replica is `batch.concurrency_per_replica`, adapted to the
engines' load when `batch.adaptive_concurrency` is on (concurrency.py).

A model with a batch pool (pools[].role "batch") counts only that pool's replicas and
their load, where the router sends its batch requests, and its bound always adapts, to a
deeper queue (concurrency.py): no interactive traffic shares those engines.

Waiters are served first come, first served, so several batches on one model take turns
line by line instead of the oldest batch holding every slot.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from hpcserve.contracts.protocol import ModelInfo, ReplicaInfo
from hpcserve.gateway.batch.concurrency import AdaptiveLimit


class ModelSlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.held_back = False  # a request had to wait for a slot since the last check
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.used < self.capacity and not self._waiters:
            self.used += 1
            return
        self.held_back = True
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

    def take_held_back(self) -> bool:
        held, self.held_back = self.held_back or bool(self._waiters), False
        return held

    def _grant(self) -> None:
        while self._waiters and self.used < self.capacity:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.used += 1
                waiter.set_result(None)


@dataclass(frozen=True)
class ModelLoad:
    """A model's live replicas and their engines' running and waiting requests, summed
    (waiting None: unknown, e.g. an alias: its bound is then not adapted)."""

    replicas: int
    waiting: int | None = None
    running: int = 0
    # The replicas are the model's batch pool: its bound adapts whatever the config says.
    batch_pool: bool = False


def model_loads(
    models: Sequence[ModelInfo], replicas: Sequence[ReplicaInfo]
) -> dict[str, ModelLoad]:
    """Each model's load as the batch bound sees it: its batch pool's replicas when it has
    one, else all its replicas. An adapter queues on its base model's engines; an alias's
    engines are not known here (waiting None)."""
    engines: dict[str, list[ReplicaInfo]] = {}
    for replica in replicas:
        engines.setdefault(replica.model, []).append(replica)
    loads: dict[str, ModelLoad] = {}
    for model in models:
        mine = engines.get(model.parent or model.id)
        if mine is None:
            loads[model.id] = ModelLoad(model.replicas)
            continue
        batch = [r for r in mine if r.role == "batch"]
        counted = batch or mine
        loads[model.id] = ModelLoad(
            len(batch) if batch else model.replicas,
            sum(r.load.waiting for r in counted),
            sum(r.load.running for r in counted),
            batch_pool=bool(batch),
        )
    return loads


class PoolSlots:
    def __init__(
        self,
        per_replica: int,
        *,
        adaptive: bool = False,
        minimum: int = 2,
        maximum: int = 1024,
    ) -> None:
        self.per_replica = per_replica
        self.adaptive, self.minimum, self.maximum = adaptive, minimum, maximum
        self._models: dict[str, ModelSlots] = {}
        self._limits: dict[str, AdaptiveLimit] = {}
        self._loads: dict[str, ModelLoad] = {}

    def for_model(self, model: str) -> ModelSlots:
        slots = self._models.get(model)
        if slots is None:
            # (a bound configured below the adaptive minimum is kept, not raised to it)
            minimum = min(self.minimum, self.per_replica)
            self._limits[model] = AdaptiveLimit(
                self.per_replica, minimum=minimum, maximum=self.maximum, adaptive=self.adaptive
            )
            slots = self._models[model] = ModelSlots(self._capacity(model))
        return slots

    def limits(self) -> dict[str, int]:
        return {model: limit.per_replica for model, limit in self._limits.items()}

    def limit(self, model: str) -> int:
        """The bound per replica now."""
        limit = self._limits.get(model)
        return limit.per_replica if limit else self.per_replica

    def _capacity(self, model: str) -> int:
        # With no replica known, one replica's worth: they wait for one to come.
        load = self._loads.get(model)
        return self.limit(model) * max(1, load.replicas if load else 0)

    def set_replicas(self, replicas: dict[str, int]) -> None:
        self.set_loads({model: ModelLoad(n) for model, n in replicas.items()}, adapt=False)

    def set_loads(self, loads: dict[str, ModelLoad], *, adapt: bool = True) -> None:
        """New replica counts; with adapt, also one control step of each model's bound."""
        self._loads = dict(loads)
        for model, slots in self._models.items():
            load = self._loads.get(model)
            if load is not None:
                limit = self._limits[model]
                limit.adaptive = self.adaptive or load.batch_pool
                limit.batch_pool = load.batch_pool
            if adapt and load is not None and load.replicas and load.waiting is not None:
                self._limits[model].update(
                    running=load.running / load.replicas,
                    waiting=load.waiting / load.replicas,
                    held_back=slots.take_held_back(),
                )
            slots.resize(self._capacity(model))

    def in_flight(self) -> int:
        return sum(s.used for s in self._models.values())
