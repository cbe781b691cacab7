"""A pool's TTFT and TPOT p95 over a short and a long window, from its engines' histograms.

Each heartbeat carries the engine's cumulative TTFT and per-request TPOT histograms (vLLM's
`vllm:time_to_first_token_seconds` and `vllm:request_time_per_output_token_seconds`,
ReplicaLoad.ttft / tpot) and the router lists them (ReplicaInfo.load). Each poll keeps a
snapshot per replica; a window's histogram is the newest counts less those of the last
snapshot at least the window old (or the oldest kept, while the replica is younger than the
window), summed over the pool's replicas; its p95 is interpolated within the bucket, as
Prometheus' histogram_quantile does. Fewer than `min_requests` in the window: no value
(a handful of slow requests is not an SLO burn). Pure but for the snapshots it keeps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

from hpcserve.contracts.protocol import LatencyHistogram, ReplicaInfo

Kind = Literal["ttft", "tpot"]


def quantile(q: float, hist: LatencyHistogram) -> float | None:
    """The q-quantile of a (delta) histogram; None when it holds nothing."""
    if hist.total <= 0 or not hist.bounds:
        return None
    rank = q * hist.total
    lower, below = 0.0, 0
    for bound, count in zip(hist.bounds, hist.counts, strict=True):
        if count >= rank:
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return hist.bounds[-1]  # beyond the last finite bound: that bound, as Prometheus does


def merge(a: LatencyHistogram, b: LatencyHistogram) -> LatencyHistogram:
    """Two histograms of the same buckets as one."""
    return LatencyHistogram(
        a.bounds, [x + y for x, y in zip(a.counts, b.counts, strict=True)],
        a.total + b.total, a.sum + b.sum,
    )  # fmt: skip


def _delta(now: LatencyHistogram, then: LatencyHistogram | None) -> LatencyHistogram:
    if then is None or then.bounds != now.bounds or then.total > now.total:  # restarted
        return now
    return LatencyHistogram(
        now.bounds, [a - b for a, b in zip(now.counts, then.counts, strict=True)],
        now.total - then.total, max(now.sum - then.sum, 0.0),
    )  # fmt: skip


def _sum(hists: Iterable[LatencyHistogram]) -> LatencyHistogram | None:
    out: LatencyHistogram | None = None
    for hist in hists:
        if out is None:
            out = hist
        elif hist.bounds == out.bounds:
            out = merge(out, hist)
    return out


class SloWindows:
    def __init__(self, keep_s: float = 3600.0) -> None:
        self.keep_s = keep_s
        # replica id -> (time, ttft, tpot) snapshots, oldest first
        self._snaps: dict[
            str, deque[tuple[float, LatencyHistogram | None, LatencyHistogram | None]]
        ] = {}

    def observe(self, replicas: Sequence[ReplicaInfo], now: float, keep_s: float) -> None:
        """This poll's histograms; keep_s: the longest window in use (older snapshots go,
        but the last one older than it stays as that window's base)."""
        seen = set()
        for r in replicas:
            seen.add(r.replica_id)
            snaps = self._snaps.setdefault(r.replica_id, deque())
            snaps.append((now, r.load.ttft, r.load.tpot))
            while len(snaps) > 2 and snaps[1][0] <= now - keep_s:
                snaps.popleft()
        for gone in self._snaps.keys() - seen:
            del self._snaps[gone]

    def p95(
        self, replica_ids: Iterable[str], kind: Kind, window_s: float, now: float, min_requests: int
    ) -> float | None:
        deltas = []
        for replica_id in replica_ids:
            snaps = self._snaps.get(replica_id)
            if not snaps or len(snaps) < 2:
                continue
            base = snaps[0]
            for snap in snaps:
                if snap[0] > now - window_s:
                    break
                base = snap
            latest = snaps[-1]
            then, current = (base[1], latest[1]) if kind == "ttft" else (base[2], latest[2])
            if current is not None and base is not latest:
                deltas.append(_delta(current, then))
        window = _sum(deltas)
        if window is None or window.total < min_requests:
            return None
        return quantile(0.95, window)
