"""The batch at which a replica's TPOT reaches the SLO, measured on the pool's engines (pure).

The planner's capacity (poolmgr/autoscale_capacity.py) is the largest batch whose modelled
TPOT stays within the SLO; the config's `target_in_flight` is a guess. Both can be far off
for the pool's real traffic and hardware: on the simulator's own scheduler (chunked prefill
stepping into the decodes, a mix of lengths) the planner's 109 in flight for a chat mix on an
L40S is 40 in truth (bench/batch_limit_accuracy.py). The engines say how it really is: each
heartbeat carries the engine's running count (its batch) and its cumulative per-request TPOT
histogram with its sum (vLLM's `vllm:request_time_per_output_token_seconds`,
contracts/protocol.py ReplicaLoad).

Each poll, per replica, the requests that finished since the last poll (the histogram's
counts and sum less the last poll's) are put at the batch the replica ran during their lives
(the mean of its running count over its last STEADY_POLLS polls), and only while that count
held steady: the requests that finish as a burst drains ran at the burst's batch, not at the
one they finish at (without this, on the simulated engine below, 11 in flight for a truth of
40). Over the last hour of
real time (in a rehearsal, k hours of its clock) they are grouped by batch in bins 10% wide.
Per bin, the share of requests over the SLO (exact where the SLO is one of vLLM's bucket
bounds, 25/50/75/100 ms...; else interpolated within its bucket, as histogram_quantile
does); the shares made non-decreasing in the batch (pool-adjacent-violators, each bin
weighed by its requests: a larger batch never steps faster), the SLO's p95 is reached where
the share crosses 5%, between the last bin at or under it and the first over it: that pair
of batches is the measured range, the crossing interpolated between them its point.

Past the batches seen (every bin within the SLO), a straight line through the bins' mean
TPOT (the sum over the count) against the batch, scaled by the TPOT spread's p95 over its
mean (read off the bins' buckets together: each bin's count at or below a bound is the
spread's CDF at bound / the bin's mean), says where the SLO would be reached: a guess.

What the figure replaces (`BatchLimit.capacity`): where the batches seen reach the SLO, the
crossing replaces the model's figure or the config's target, lower or higher. Past them, a
prior above the guess comes down to it (the line already rises towards the SLO), and one
below the guess goes up to it, but no further than twice the largest batch seen (the next
hour's larger batches check the guess); a prior between the two holds. No figure
with too few requests (MIN_REQUESTS, MIN_BIN_REQUESTS per bin), batches spanning under
MIN_SPREAD, every bin over the SLO (not a batch limit here: the SLO burn rule scales up for
it), or, past the data, TPOT not rising with the batch (by MIN_RISE).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hpcserve.contracts.protocol import LatencyHistogram, ReplicaInfo

# An hour of real traffic: long enough for a few hundred requests at several batches, short
# enough that a change of the mix (longer prompts, another model version) shows within it.
WINDOW_S = 3600.0
# Fewer real requests than this in the window, or than MIN_BIN_REQUESTS in a bin: no figure
# (a bin's p95 over 20 requests is its largest but one).
MIN_REQUESTS = 200
MIN_BIN_REQUESTS = 20
# Bins 10% wide in batch: 1, 2, ..., 10, 11, 12, 13, 15, 16, 18, 20, ...
BIN_RATIO = 1.1
# The batches seen must span this ratio (largest over smallest bin).
MIN_SPREAD = 1.5
# A poll's finished requests count at the replica's mean running count over its last
# STEADY_POLLS polls (their lifetimes: a request's TPOT is its batch's over its whole life),
# and only while that count held steady: within STEADY_SHARE of its mean, or three standard
# deviations of a Poisson count of that mean (a steady load's own wobble at small batches).
# While the load moves fast (a burst's end drains a replica in a poll or two) the
# requests finishing ran at another batch than the one they finish at.
STEADY_POLLS = 4
STEADY_SHARE = 0.25
# The SLO is on the p95: at most this share of a batch's requests over it.
OVER_SHARE = 0.05
# Over the batches seen the line must rise by this share of its value at the smallest, or
# TPOT is flat in the batch (no limit seen).
MIN_RISE = 0.02
# A figure beyond the batches seen raises the capacity to at most this many times the largest.
MAX_RAISE = 2.0


@dataclass(frozen=True)
class BatchLimit:
    low: float  # the SLO's p95 is reached between these batches (measured or guessed)
    high: float
    batch: float  # where within them: the crossing interpolated, or the line's guess
    reached: bool  # True: within the batches seen; False: past them (a guess)
    requests: int  # the real requests it is measured over
    smallest: float  # the smallest and largest bins' mean batch
    largest: float
    slo_s: float
    over: tuple[float, float] = (0.0, 0.0)  # the shares over the SLO at low and high

    def capacity(self, prior: int) -> int:
        """What one replica carries, given the model's figure or the config's target: the
        crossing where the batches seen reach the SLO; past them, the prior where the range
        holds it, else the range's nearer end."""
        if self.reached:
            return max(1, math.floor(self.batch))
        return max(1, math.floor(min(max(prior, self.low), self.high)))

    def describe(self) -> str:
        seen = f"{self.requests} requests at batches {self.smallest:.3g}-{self.largest:.3g}"
        slo = f"{self.slo_s * 1e3:.3g} ms"
        if self.reached:
            lo, hi = self.over
            return (
                f"TPOT p95 reaches {slo} at batch {self.batch:.3g}, between {self.low:.3g} "
                f"({lo:.1%} over) and {self.high:.3g} ({hi:.1%} over); {seen}"
            )
        return (
            f"TPOT p95 within {slo} up to batch {self.largest:.3g}, the largest seen; its "
            f"mean's line reaches {slo} at {self.batch:.3g}; {seen}"
        )


class _Finished(NamedTuple):
    """The requests one replica finished between two polls."""

    end: float  # the poll's time (the autoscaler's clock)
    batch: float  # the replica's mean running count in between
    tpot: LatencyHistogram  # their TPOTs (counts <= each bound, and all)
    speedup: float  # the rehearsal's clock speed then (1: real time)


class _Bin:
    """The requests finished at batches within one bin over the window, summed as they come
    and taken out as they leave it (a poll reads the bins, not every poll of the hour)."""

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0
        self.sum = 0.0
        self.batch_requests = 0.0  # sum of batch x requests: the bin's mean batch over total

    def add(self, f: _Finished, sign: int) -> None:
        for i, count in enumerate(f.tpot.counts):
            self.counts[i] += sign * count
        self.total += sign * f.tpot.total
        self.sum += sign * f.tpot.sum
        self.batch_requests += sign * f.batch * f.tpot.total

    def histogram(self) -> LatencyHistogram:
        return LatencyHistogram(self.bounds, list(self.counts), self.total, self.sum)


def _bin(batch: float) -> int:
    return round(math.log(batch) / math.log(BIN_RATIO))


def _minus(now: LatencyHistogram, then: LatencyHistogram) -> LatencyHistogram | None:
    """now - then; None when the engine restarted in between (counts went back, or the
    buckets changed): what it finished meanwhile is not known."""
    if now.bounds != then.bounds or now.total < then.total:
        return None
    counts = [a - b for a, b in zip(now.counts, then.counts, strict=True)]
    if any(c < 0 for c in counts):
        return None
    return LatencyHistogram(now.bounds, counts, now.total - then.total, now.sum - then.sum)


def _share_over(hist: LatencyHistogram, slo_s: float) -> float:
    """The share of a histogram's requests over slo_s (linear within its bucket)."""
    lower, below = 0.0, 0
    for bound, count in zip(hist.bounds, hist.counts, strict=True):
        if bound >= slo_s:
            inside = (slo_s - lower) / (bound - lower) if bound > lower else 1.0
            return 1.0 - (below + (count - below) * inside) / hist.total
        lower, below = bound, count
    return 1.0 - below / hist.total  # past the last bound: what is beyond it


def _monotone(values: Sequence[float], weights: Sequence[int]) -> list[float]:
    """The weighted least-squares non-decreasing fit (pool-adjacent-violators)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [v for v, _, n in blocks for _ in range(int(n))]


def _fit(points: Sequence[tuple[float, float, int]]) -> tuple[float, float]:
    """Weighted least squares y = a + s x over (x, y, weight); (a, s)."""
    total = sum(w for _, _, w in points)
    mx = sum(x * w for x, _, w in points) / total
    my = sum(y * w for _, y, w in points) / total
    sxx = sum(w * (x - mx) ** 2 for x, _, w in points)
    sxy = sum(w * (x - mx) * (y - my) for x, y, w in points)
    slope = sxy / sxx if sxx > 0 else 0.0
    return my - slope * mx, slope


def _p95_over_mean(cdf: Sequence[tuple[float, float]]) -> float | None:
    """The spread's p95 from (TPOT over the mean, share at or below) points: interpolated
    between the last point below 95% and the first at or above it past that (at least 1,
    the mean); None when no point reaches 95% (its tail is past every bucket)."""
    below = max((p for p in cdf if p[1] < 0.95), default=None)
    above = min((p for p in cdf if p[1] >= 0.95 and (below is None or p[0] > below[0])),
                default=None)  # fmt: skip
    if above is None:
        return None
    if below is None:
        return max(1.0, above[0])
    (x0, f0), (x1, f1) = below, above
    return max(1.0, x0 + (x1 - x0) * (0.95 - f0) / (f1 - f0))


class BatchLimits:
    """Per pool, the requests its replicas finished over the last WINDOW_S, by batch."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        min_requests: int = MIN_REQUESTS,
        min_bin_requests: int = MIN_BIN_REQUESTS,
    ) -> None:
        self.window_s = window_s
        self.min_requests = min_requests
        self.min_bin_requests = min_bin_requests
        self._finished: dict[str, deque[_Finished]] = {}
        self._bins: dict[str, dict[int, _Bin]] = {}  # pool -> bin -> what _finished holds
        # pool -> replica id -> (running, TPOT histogram) at the last poll
        # pool -> replica id -> (its running counts at the last polls, oldest first; its
        # TPOT histogram at the last poll)
        self._last: dict[str, dict[str, tuple[tuple[int, ...], LatencyHistogram | None]]] = {}

    def observe(
        self, pool: str, replicas: Sequence[ReplicaInfo], now: float, speedup: float = 1.0
    ) -> None:
        """This poll's list of the pool's replicas (draining ones too: they still run what
        was routed to them); `speedup`, a rehearsal's clock speed (its clock `now` reads)."""
        finished = self._finished.setdefault(pool, deque())
        before = self._last.get(pool, {})
        seen: dict[str, tuple[tuple[int, ...], LatencyHistogram | None]] = {}
        for r in replicas:
            last = before.get(r.replica_id)
            counts = ((*last[0], r.load.running) if last else (r.load.running,))[-STEADY_POLLS:]
            seen[r.replica_id] = (counts, r.load.tpot)
            if last is None or last[1] is None or r.load.tpot is None:
                continue
            delta = _minus(r.load.tpot, last[1])
            if delta is None or delta.total <= 0 or delta.sum <= 0 or len(counts) < 2:
                continue
            batch = sum(counts) / len(counts)
            wobble = max(STEADY_SHARE * batch, 3 * math.sqrt(batch))
            if batch >= 0.5 and max(counts) - min(counts) <= wobble:
                self._add(pool, _Finished(now, batch, delta, speedup))
        self._last[pool] = seen
        while finished and finished[0].end <= now - self.window_s * finished[0].speedup:
            gone = finished.popleft()
            self._bins[pool][_bin(gone.batch)].add(gone, -1)

    def _add(self, pool: str, f: _Finished) -> None:
        bins = self._bins.setdefault(pool, {})
        key = _bin(f.batch)
        into = bins.get(key)
        if into is None:
            into = bins[key] = _Bin(list(f.tpot.bounds))
        elif into.bounds != f.tpot.bounds:  # an engine of other buckets: a bin keeps one kind
            if into.total > 0:
                return
            into = bins[key] = _Bin(list(f.tpot.bounds))
        into.add(f, 1)
        self._finished[pool].append(f)

    def gap(self) -> None:
        """A poll without the router's list: the next poll's counts span unseen time, at
        batches nobody saw."""
        self._last.clear()

    def forget(self, pool: str) -> None:
        self._finished.pop(pool, None)
        self._bins.pop(pool, None)
        self._last.pop(pool, None)

    def measured(self, pool: str, slo_s: float) -> BatchLimit | None:
        """The pool's measured batch at its TPOT SLO; None when the window cannot say."""
        rows = [
            (b.batch_requests / b.total, b.histogram())
            for b in self._bins.get(pool, {}).values()
            if b.total >= self.min_bin_requests
        ]  # (batch, its requests' TPOTs)
        rows.sort(key=lambda row: row[0])
        requests = sum(h.total for _, h in rows)
        if requests < self.min_requests or len(rows) < 2:
            return None
        smallest, largest = rows[0][0], rows[-1][0]
        if largest < MIN_SPREAD * smallest:
            return None
        over = _monotone([_share_over(h, slo_s) for _, h in rows], [h.total for _, h in rows])
        if over[0] > OVER_SHARE:  # over the SLO at every batch seen: not a batch limit here
            return None
        for k in range(1, len(rows)):
            if over[k] > OVER_SHARE:
                (b0, f0), (b1, f1) = (rows[k - 1][0], over[k - 1]), (rows[k][0], over[k])
                at = b0 + (b1 - b0) * (OVER_SHARE - f0) / (f1 - f0)
                return BatchLimit(b0, b1, at, True, requests, smallest, largest, slo_s, (f0, f1))
        guess = _past_the_data(rows, slo_s)
        if guess is None:
            return None
        low = max(largest, min(guess, MAX_RAISE * largest))
        return BatchLimit(low, max(low, guess), guess, False, requests, smallest, largest, slo_s)


def _past_the_data(rows: Sequence[tuple[float, LatencyHistogram]], slo_s: float) -> float | None:
    """Where the line through the bins' mean TPOT, scaled by the spread's p95 over the mean,
    reaches slo_s; None when TPOT does not rise with the batch, or the spread's tail is past
    every bucket."""
    points = [(b, h.sum / h.total, h.total) for b, h in rows if h.sum > 0]
    if len(points) < 2:
        return None
    spread = [
        (bound / mean, count / h.total)
        for (_, mean, _), (_, h) in zip(points, [r for r in rows if r[1].sum > 0], strict=True)
        for bound, count in zip(h.bounds, h.counts, strict=True)
    ]
    intercept, slope = _fit(points)
    ratio = _p95_over_mean(spread)
    smallest, largest = points[0][0], points[-1][0]
    if ratio is None or slope * (largest - smallest) <= MIN_RISE * (intercept + slope * smallest):
        return None
    return (slo_s / ratio - intercept) / slope
