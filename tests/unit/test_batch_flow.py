"""What paces batch requests: slots per model (FIFO, resized with the replicas, adapted to
the engines' queues), the tenant's batch tokens per minute across gateways, and the progress
`hpcserve batches` shows."""

from __future__ import annotations

import asyncio

from hpcserve.contracts import protocol as p
from hpcserve.gateway.batch.concurrency import AdaptiveLimit
from hpcserve.gateway.batch.limiter import BatchTokens
from hpcserve.gateway.batch.progress import format_batches, progress_of
from hpcserve.gateway.batch.slots import ModelLoad, ModelSlots, PoolSlots
from hpcserve.gateway.batch.store import BatchRecord
from hpcserve.gateway.quota import QuotaGate
from hpcserve.router.quota_book import QuotaBook


def test_slots_are_granted_first_come_first_served() -> None:
    async def scenario() -> list[str]:
        slots = ModelSlots(1)
        order: list[str] = []
        await slots.acquire()

        async def take(name: str) -> None:
            await slots.acquire()
            order.append(name)

        waiters = [asyncio.create_task(take(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0)
        waiters[1].cancel()  # a waiter that gives up does not keep a slot
        for _ in range(2):
            slots.release()
            await asyncio.sleep(0)
        await asyncio.gather(*waiters, return_exceptions=True)
        assert slots.used == 1
        return order

    assert asyncio.run(scenario()) == ["a", "c"]


def test_pool_slots_scale_with_live_replicas() -> None:
    pool = PoolSlots(per_replica=4)
    slots = pool.for_model("m")
    assert slots.capacity == 4  # no replica known: one replica's worth
    pool.set_replicas({"m": 3})
    assert slots.capacity == 12
    pool.set_replicas({})
    assert slots.capacity == 4
    # A bound configured below the adaptive minimum (2) is kept as configured.
    one = PoolSlots(per_replica=1).for_model("m")
    assert one.capacity == 1


def test_the_bound_grows_while_engines_queue_little_and_backs_off_when_they_queue() -> None:
    limit = AdaptiveLimit(32, minimum=2, maximum=1024, adaptive=True)

    def step(running: float, waiting: float, held_back: bool = True) -> int:
        return limit.update(running=running, waiting=waiting, held_back=held_back)

    assert step(30, 0) == 64  # slow start
    assert step(60, 3) == 128  # 3 waiting beside 60 running: arrivals within a step
    assert step(100, 0, held_back=False) == 128  # the batch does not fill the bound
    assert step(100, 10) == 128  # in the target band: hold
    assert step(100, 30) == 128  # a queue of more than a quarter: once may be a burst
    assert step(100, 30) == 102  # twice in a row: x 0.8, slow start ends
    assert step(100, 0) == 115  # then + 1/8
    assert step(100, 5) == 129
    for _ in range(40):
        step(0, 0)
    assert limit.per_replica == 1024  # the maximum
    step(200, 400)
    assert step(200, 400) == 250  # far over what runs: down to it plus a quarter at once
    for _ in range(40):
        step(0, 1000)
    assert limit.per_replica == 2  # the minimum
    fixed = AdaptiveLimit(32, minimum=2, maximum=1024, adaptive=False)
    assert fixed.update(running=0, waiting=0, held_back=True) == 32


def test_pool_slots_adapt_per_model_to_the_engines_queues() -> None:
    async def scenario() -> None:
        pool = PoolSlots(per_replica=4, adaptive=True)
        busy, idle = pool.for_model("busy"), pool.for_model("idle")
        for _ in range(4):
            await busy.acquire()
        waiter = asyncio.create_task(busy.acquire())  # held back by the bound
        await asyncio.sleep(0)
        loads = {"busy": ModelLoad(2, waiting=0), "idle": ModelLoad(2, waiting=0)}
        pool.set_loads(loads, adapt=False)  # a replica count only: no control step
        assert (busy.capacity, idle.capacity) == (8, 8)
        await waiter
        pool.set_loads(loads)
        assert pool.limits() == {"busy": 8, "idle": 4}  # only the one held back grows
        assert busy.capacity == 16
        for _ in range(2):
            pool.set_loads({"busy": ModelLoad(2, waiting=40, running=8), "idle": ModelLoad(2)})
        assert pool.limits() == {"busy": 5, "idle": 4}  # unknown waiting: unchanged

    asyncio.run(scenario())


def test_batch_tokens_per_min_hold_across_gateways_through_the_quota_book() -> None:
    now = [1000.0]
    book = QuotaBook()
    gates = [QuotaGate(f"gw{i}", clock=lambda: now[0]) for i in range(2)]
    first, second = (BatchTokens(g, {"t": 600}) for g in gates)

    def sync() -> None:
        for i, gate in enumerate(gates):
            usage = gate.report(keepalive=True) or []
            gate.apply(book.report(p.QuotaReport(i, f"gw{i}", usage), now[0]))

    assert first.wait_s("t") == 0
    first.charge("t", 650)  # one request may take the tenant over its minute
    assert first.wait_s("t") > 0
    assert second.wait_s("t") == 0  # the other gateway has not heard of it yet
    sync()
    assert second.wait_s("t") > 0  # now it has: the runner that takes over waits too
    assert first.wait_s("other") == second.wait_s("other") == 0  # unlimited tenant
    now[0] += 61
    sync()
    assert first.wait_s("t") == second.wait_s("t") == 0  # the usage left the window


def batch(**fields: object) -> BatchRecord:
    base = dict(
        id="batch_1", tenant="t", endpoint="/v1/chat/completions", input_file_id="file-1",
        completion_window="24h", status="in_progress", created_at=1000, expires_at=90000,
        total=100, in_progress_at=1000,
    )  # fmt: skip
    return BatchRecord(**{**base, **fields})  # type: ignore[arg-type]


def test_progress_rates_and_eta() -> None:
    running = batch(completed=20, failed=5, input_tokens=3000, output_tokens=2000)
    assert progress_of(running, now=1100) == progress_of(running, now=1100.0)
    p = progress_of(running, now=1100)
    assert (p.done, p.tokens_per_s, p.eta_s) == (25, 50.0, 300.0)
    ended = batch(status="completed", completed=100, completed_at=1200, output_tokens=4000)
    p = progress_of(ended, now=5000)
    assert (p.tokens_per_s, p.eta_s) == (20.0, None)
    waiting = batch(status="validating", in_progress_at=None)
    assert progress_of(waiting, now=1100).tokens_per_s is None
    table = format_batches([running, waiting], now=1100).splitlines()
    assert table[0].split() == [
        "BATCH", "TENANT", "STATUS", "DONE", "FAILED", "TOTAL", "TOKENS/S", "ETA", "AGE"
    ]  # fmt: skip
    assert table[1].split() == [
        "batch_1",
        "t",
        "in_progress",
        "20",
        "5",
        "100",
        "50",
        "5m00s",
        "1m40s",
    ]
    assert table[2].split()[-3:] == ["-", "-", "1m40s"]
