"""How long a new request would queue at a replica before it starts: the overflow trigger.

A gateway that may send a request elsewhere (a tenant whose overflow is "external") puts
its queue budget in `Route.queue_budget_s`; the router routes it only to replicas whose
estimated wait is within the budget, and otherwise answers OVER_QUEUE_BUDGET with the
shortest wait it estimated, so the gateway overflows. Requests without a budget (data-
resident tenants, overflow "never") are routed as before and queue at the replica.

Per replica (`ServiceTracker`), from what the router sees and engines report:
- slots: how many requests the engine runs at once, learned as the largest `running` an
  engine reported while it also reported `waiting` (a queue means every slot was taken);
  unknown until the engine has queued once;
- interval: the mean time between two completions while the replica had work (an EWMA of
  the router's Releases), i.e. 1 / its service rate; it covers the engine's concurrency,
  as a replica running 8 requests of 4 s each completes one every 0.5 s;
- the open interval: time since the last completion (or since work began) while busy and
  the engine reports work; a replica that completes nothing for longer than its mean counts
  as that slow.

Completions are timed (`Registry.track_service`) from the first request with a budget on.

wait = 0 while a slot is free; otherwise (requests queued ahead + 1) x max(interval, open
interval), with ahead = max(engine waiting, requests at the replica - slots) and requests
at the replica = max(router's in-flight count, engine's running + waiting). With slots
unknown, only the engine's reported queue counts. Failure mode: between heartbeats a burst
is seen only through the router's in-flight count, so before the first queue has taught the
slots, a burst may be routed to a replica that then queues it (up to one heartbeat).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hpcserve.contracts.protocol import ReplicaLoad

if TYPE_CHECKING:
    from hpcserve.router.registry import Replica

# Weight of the newest completion interval in the EWMA.
_ALPHA = 0.2

clock: Callable[[], float] = time.monotonic


class ServiceTracker:
    """One replica's service rate and batch size, fed by routing, releases and heartbeats."""

    __slots__ = ("busy_since", "interval", "slots")

    def __init__(self) -> None:
        self.slots = 0  # 0: not learned yet
        self.interval: float | None = None
        self.busy_since: float | None = None  # start of the open interval (None: idle)

    def started(self, now: float) -> None:
        """The router's in-flight count went from 0 to 1."""
        self.busy_since = now

    def finished(self, now: float, still_busy: bool) -> None:
        """A request was released; `still_busy`: others remain in flight."""
        if self.busy_since is not None:
            took = max(now - self.busy_since, 0.0)
            self.interval = (
                took if self.interval is None else (1 - _ALPHA) * self.interval + _ALPHA * took
            )
        self.busy_since = now if still_busy else None

    def observed(self, load: ReplicaLoad) -> None:
        """An engine's report (Register, Heartbeat)."""
        if load.waiting > 0 and load.running > self.slots:
            self.slots = load.running

    def wait_s(self, in_flight: int, load: ReplicaLoad, now: float) -> float:
        """Seconds a request sent now would queue before it starts (0: a slot is free)."""
        if self.slots:
            at_replica = max(in_flight, load.running + load.waiting)
            if at_replica < self.slots:
                return 0.0
            ahead = max(load.waiting, at_replica - self.slots)
        elif load.waiting > 0:
            ahead = load.waiting
        else:
            return 0.0
        # Stalled only while the engine itself reports work (a Release lost with a gateway
        # must not make a replica look stuck forever).
        engine_busy = load.running or load.waiting
        busy_since = self.busy_since if engine_busy else None
        open_interval = now - busy_since if busy_since is not None else 0.0
        return (ahead + 1) * max(self.interval or 0.0, open_interval)


def within_budget(
    candidates: Sequence[Replica], budget_s: float
) -> tuple[Sequence[Replica], float]:
    """The routable candidates whose wait is within `budget_s` (`candidates` itself when all
    are), and the shortest wait estimated (0 when some slot is free)."""
    now = clock()
    within: list[Replica] = []
    shortest = -1.0
    for replica in candidates:
        if not replica.routable:
            continue
        wait = replica.service.wait_s(replica.in_flight, replica.load, now)
        if shortest < 0 or wait < shortest:
            shortest = wait
        if wait <= budget_s:
            within.append(replica)
    if shortest < 0:  # none routable: not a matter of queues
        return candidates, 0.0
    return (candidates if len(within) == len(candidates) else within), shortest
