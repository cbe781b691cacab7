"""What paces batch requests: slots per model (FIFO, resized with the replicas), the tenant's
batch tokens per minute, and the progress `hpcserve batches` shows."""

from __future__ import annotations

import asyncio

from hpcserve.gateway.batch.limiter import TokenRate
from hpcserve.gateway.batch.progress import format_batches, progress_of
from hpcserve.gateway.batch.slots import ModelSlots, PoolSlots
from hpcserve.gateway.batch.store import BatchRecord


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


def test_token_rate_lets_a_minute_through_then_paces() -> None:
    now = [0.0]
    rate = TokenRate(600, clock=lambda: now[0])  # 10 tokens a second
    assert rate.wait_s() == 0
    rate.charge(650)  # one request may take the bucket below zero
    assert rate.wait_s() == (1 + 50) * 60 / 600
    now[0] += 5.1
    assert rate.wait_s() == 0
    assert TokenRate(0).wait_s() == 0  # unlimited


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
