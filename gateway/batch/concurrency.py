"""How many batch requests to keep in flight per replica of a model: adapted to what the
engines report, so their batches stay full without a hand-tuned number (AIMD).

Every `ADAPT_S` (an engine heartbeat: that is how fresh the load is) the runner reports,
per model, the engines' mean running and waiting requests per replica and whether the bound
held batch requests back since the last report. Then:

- the engines queue a lot (waiting > `QUEUE_HIGH` per replica and more than a quarter of
  what runs) at two reports in a row (one can be a burst still being prefilled, as when a
  batch starts): their batches are full (`max_num_seqs`, or no KV room) and more in flight
  only lengthens their queues: decrease, x `DECREASE`, and to no more than what runs plus
  a quarter;
- the engines queue little (waiting < `QUEUE_LOW` per replica, or under a sixteenth of what
  runs: requests that arrived during the current step) and the bound held requests back:
  their batches have room: increase, x `SLOW_START` until the first decrease, then by an
  eighth (TCP's slow start and congestion avoidance);
- otherwise hold: the queue is in the target band, or the batch has too few lines left to
  fill the bound.

So the bound settles where the engines run all they can plus a short queue of batch
requests, which refills a finished request's place at once instead of after a round trip
through the gateway. Under the engines' priority scheduling (pools' default) that queue
never delays an interactive request: it is admitted ahead of every queued batch request.

A batch pool's engines (pools[].role "batch", `batch_pool`) serve no interactive traffic,
so their queue may be deeper: `BATCH_POOL_QUEUE` (a half of what runs) instead of a quarter,
so a finished request's place is refilled from the engine's own queue; and a decrease never
goes below what they run, so an overshoot that takes long to drain (long outputs) does not
drive the bound to its minimum and starve them once it has drained.

Failure mode: with stale loads (a router outage) nothing changes; the bound stays within
[`minimum`, `maximum`] whatever the engines report.
"""

from __future__ import annotations

ADAPT_S = 2.0
QUEUE_LOW = 1.0
QUEUE_HIGH = 4.0
DECREASE = 0.8
TARGET_QUEUE = 0.25  # of what runs, after a decrease
BATCH_POOL_QUEUE = 0.5  # the same for a batch pool's engines
SLOW_START = 2.0


class AdaptiveLimit:
    def __init__(self, initial: int, *, minimum: int, maximum: int, adaptive: bool) -> None:
        self.minimum, self.maximum = minimum, max(minimum, maximum)
        self.adaptive = adaptive
        self.value = float(min(max(initial, minimum), self.maximum))
        self.slow_start = True
        self.queued = False  # the engines queued a lot at the last step
        self.batch_pool = False

    @property
    def queue_share(self) -> float:
        return BATCH_POOL_QUEUE if self.batch_pool else TARGET_QUEUE

    @property
    def per_replica(self) -> int:
        return int(self.value)

    def update(self, *, running: float, waiting: float, held_back: bool) -> int:
        """One control step from the engines' mean running and waiting requests per replica;
        returns the new bound per replica."""
        if not self.adaptive:
            return self.per_replica
        queued = waiting > max(QUEUE_HIGH, running * self.queue_share)
        was_queued, self.queued = self.queued, queued
        if queued and was_queued:
            # What runs is what the engines can batch: no more than queue_share above it, so an
            # overshoot (loads lag a heartbeat behind the bound) ends in one step.
            target = min(self.value * DECREASE, running * (1 + self.queue_share))
            if self.batch_pool:
                target = max(target, running)
            self.value = max(float(self.minimum), target)
            self.slow_start = False
        elif not queued and waiting < max(QUEUE_LOW, running / 16) and held_back:
            grown = self.value * SLOW_START if self.slow_start else self.value + self.value / 8
            self.value = min(float(self.maximum), max(grown, self.value + 1))
        return self.per_replica
