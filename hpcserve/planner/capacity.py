"""What one replica sustains for a workload at a batch size, and the largest batch an SLO allows.

Two workloads: ``streams`` (N sequences decoding continuously, each wanting X tokens/s) and
``requests`` (a rate of requests of P prompt and O output tokens). For requests, the
steady state with B sequences in flight finishes B / O requests per step, so each step also
prefills B x P / O prompt tokens on average: TPOT is that mixed step's time and the replica
serves B / (O x TPOT) requests/s.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from hpcserve.planner.perfmodel import StepBatch, StepModel, decode_step, ttft_s


class OperatingPoint(msgspec.Struct, frozen=True):
    """One replica at a batch size: its latencies and what it sustains."""

    batch: int
    tpot_s: float
    ttft_s: float
    output_tokens_per_s: float  # whole replica
    requests_per_s: float  # whole replica; 0 for streams
    bound: str


class Limits(msgspec.Struct, frozen=True):
    max_batch: int  # KV capacity and the engine's max_num_seqs
    tpot_s: float | None = None
    ttft_s: float | None = None

    def met_by(self, point: OperatingPoint) -> bool:
        tpot_ok = self.tpot_s is None or point.tpot_s <= self.tpot_s
        ttft_ok = self.ttft_s is None or point.ttft_s <= self.ttft_s
        return tpot_ok and ttft_ok


def mixed_step(batch: float, prompt: int, output: int) -> StepBatch:
    """The average step of B requests in flight: B decodes, B/O prompts' worth of prefill."""
    started = batch / output
    prefill = StepBatch(
        prefill_tokens=started * prompt,
        prefill_seqs=started,
        prefill_attn_pairs=started * prompt * (prompt + 1) / 2,
    )
    return decode_step(batch, prompt + output / 2) + prefill


def streams_point(
    model: StepModel, batch: int, *, context: int, prompt: int, token_budget: int
) -> OperatingPoint:
    """Decode-only steps with every sequence at ``context`` tokens (the worst case)."""
    step = model.step_time(decode_step(batch, context))
    ttft = ttft_s(model, prompt, token_budget=token_budget, running=batch - 1, context=context)
    return OperatingPoint(batch, step.total_s, ttft, batch / step.total_s, 0.0, step.bound)


def requests_point(
    model: StepModel, batch: int, *, prompt: int, output: int, token_budget: int
) -> OperatingPoint:
    step = model.step_time(mixed_step(batch, prompt, output))
    ttft = ttft_s(
        model, prompt, token_budget=token_budget, running=batch - 1, context=prompt + output / 2
    )
    rate = batch / (output * step.total_s)
    return OperatingPoint(batch, step.total_s, ttft, batch / step.total_s, rate, step.bound)


def best_point(
    point_at: Callable[[int], OperatingPoint], limits: Limits
) -> tuple[OperatingPoint, bool]:
    """The largest batch up to ``limits.max_batch`` that meets the latency limits.

    Latencies grow with batch, so this is a binary search. Returns batch 1 and False when
    even batch 1 misses a limit.
    """
    first = point_at(1)
    if not limits.met_by(first):
        return first, False
    low, high = 1, max(1, limits.max_batch)
    while low < high:
        middle = (low + high + 1) // 2
        if limits.met_by(point_at(middle)):
            low = middle
        else:
            high = middle - 1
    return point_at(low), True


def point_for_demand(
    point_at: Callable[[int], OperatingPoint],
    demand: float,
    capacity: Callable[[OperatingPoint], float],
    max_batch: int,
) -> OperatingPoint:
    """The smallest batch whose ``capacity`` covers ``demand``: where a replica settles.

    Capacity grows with batch, so this is a binary search; ``max_batch`` if none covers it.
    """
    low, high = 1, max(1, max_batch)
    while low < high:
        middle = (low + high) // 2
        if capacity(point_at(middle)) >= demand:
            high = middle
        else:
            low = middle + 1
    return point_at(low)
