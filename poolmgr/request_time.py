"""How long a request runs in one of a pool's replicas, measured by Little's law (pure).

Over a window, the requests the pool's engines ran (`num_requests_running`, integrated over
time) divided by the requests routed to its replicas is the mean time a request runs in a
replica: L = lambda x W, with L the running count, so a request's wait in its engine's queue
is not in it, as it is not in the planner's figure (one replica's requests in flight over
the requests/s it finishes at that load). The autoscaler sizes a forecast rate with it
(requests in flight = rate x time in a replica; poolmgr/autoscale.py `Signals.request_s`):
when the pool's real prompts and outputs are longer or shorter than the ones its
`autoscale.capacity` states, or its engines run slower or faster than the roofline, the
measured time is the one that holds.

The pool manager observes each pool once a poll: the running count summed over the pool's
replicas, and the requests routed to them since the last poll (each replica's `routed`
count against the last poll's). Between two polls the running count is taken as a straight
line (the trapezoid). A window cuts the requests running at its two edges: while the load
rises, more are cut at its end (counted, most of their time still to come) than at its
start, and running / routed reads short (8.5% for 6 s requests over a 60 s window while the
rate grows ten-fold; tests/unit/test_request_time.py). So the count divided by is the
requests routed less half the growth of those in the engines (running + waiting) over the
window, the mean of the requests that came and those that left: the edges' errors cancel
to first order. A poll without the router's list, or a gap, starts afresh: nothing is
integrated over time nobody saw. In a rehearsal (poolmgr/rehearsal_clock.py) the clock runs
k times faster and each request counts k times, so the ratio stays in real seconds, as the
requests' own times are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

# The window the time is measured over: an hour of the pool's traffic (a request's time in a
# replica changes with the mix of requests, slowly; much longer than a request, so the
# requests cut by the window's edges do not count).
WINDOW_S = 3600.0
# Fewer real requests than this in the window: no measurement (the model's figure holds).
MIN_REQUESTS = 100


@dataclass(frozen=True)
class MeasuredTime:
    seconds: float  # a request's mean time running in a replica
    requests: int  # the real requests it is measured over
    window_s: float  # the time they span (at most WINDOW_S)

    def describe(self) -> str:
        return f"{self.seconds:.3g} s measured over {self.requests} requests"


class _Poll(NamedTuple):
    """What a pool did between two polls."""

    start: float
    end: float
    running_s: float  # the running count integrated from start to end
    requests: int  # routed in between
    weight: float  # how many times each counts (a rehearsal's speedup)
    held_before: int  # requests in the engines (running + waiting) at start
    held_after: int  # ... at end


class RequestTimes:
    """Per pool, the running requests integrated over time and the requests routed, over
    the last WINDOW_S."""

    def __init__(self, window_s: float = WINDOW_S, min_requests: int = MIN_REQUESTS) -> None:
        self.window_s = window_s
        self.min_requests = min_requests
        self._polls: dict[str, deque[_Poll]] = {}
        # pool -> (time, running, in the engines) at the last poll
        self._last: dict[str, tuple[float, int, int]] = {}

    def observe(
        self,
        pool: str,
        now: float,
        running: int,
        requests: int,
        weight: float = 1.0,
        in_engines: int | None = None,
    ) -> None:
        """One poll: `running` requests in the pool's engines now (`in_engines` with those
        waiting in their queues; default: the running ones), `requests` routed to its
        replicas since the last poll; `weight`, how many times each request counts (a
        rehearsal's speedup, whose clock `now` reads)."""
        held = running if in_engines is None else in_engines
        last = self._last.get(pool)
        self._last[pool] = (now, running, held)
        if last is None or now <= last[0]:
            return
        start, before, held_before = last
        polls = self._polls.setdefault(pool, deque())
        running_s = (before + running) / 2 * (now - start)
        polls.append(_Poll(start, now, running_s, requests, weight, held_before, held))
        while polls and polls[0].end <= now - self.window_s:
            polls.popleft()

    def gap(self) -> None:
        """A poll without the router's list: what happened until the next one is unknown."""
        self._last.clear()

    def forget(self, pool: str) -> None:
        self._polls.pop(pool, None)
        self._last.pop(pool, None)

    def measured(self, pool: str) -> MeasuredTime | None:
        """The pool's measured time; None with fewer than `min_requests` in the window."""
        polls = self._polls.get(pool)
        if not polls:
            return None
        requests = sum(p.requests for p in polls)
        running_s = sum(p.running_s for p in polls)
        if requests < self.min_requests or running_s <= 0:
            return None
        # The requests that came less half of those that stayed (module docstring); each
        # poll's growth at that poll's weight, as its requests were counted.
        weighted = sum(p.requests * p.weight for p in polls)
        counted = weighted - sum((p.held_after - p.held_before) * p.weight for p in polls) / 2
        if counted < weighted / 2:  # a window mostly filling up: no figure yet
            return None
        return MeasuredTime(running_s / counted, requests, polls[-1].end - polls[0].start)
