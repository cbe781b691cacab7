"""Each pool's cold start, measured from its own jobs and kept in the state dir.

A replica's cold start is Slurm's queue wait (submit -> start, Slurm's own times) plus its
start-up: staging the weights and loading them until the engine registers with the router
(start -> registration, the registration time being the router's age of the replica). The
engine does not report staging and loading apart, so the second part is both. Each job of
ours is measured once, the first poll that sees it serve; a pool keeps its last `KEEP`
measurements in `<state_dir>/cold-starts.json` (written atomically when one is added), so a
restarted pool manager knows them at once.

The estimate is the median of each part and the p90 of their sum over those measurements:
the p90 is the lead the autoscaler gives a scheduled floor (poolmgr/autoscale_schedule.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, Gauge

from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.poolmgr.identity import JobIdentity
from hpcserve.poolmgr.state_files import write_atomic
from hpcserve.slurm.parse import SlurmJob

log = logging.getLogger(__name__)

COLD_STARTS_FILE = "cold-starts.json"
KEEP = 20  # measurements kept per pool


class ColdStartSample(msgspec.Struct, frozen=True):
    job_id: int
    queue_s: float  # submit -> start
    startup_s: float  # start -> registered (staging + load)
    at: float  # when it was measured (epoch seconds)

    @property
    def total_s(self) -> float:
        return self.queue_s + self.startup_s


class ColdStartEstimate(msgspec.Struct, frozen=True):
    queue_s: float  # medians
    startup_s: float
    total_p90_s: float
    samples: int

    def describe(self) -> str:
        return (
            f"{self.total_p90_s:.0f} s p90 (median queue {self.queue_s:.0f} s + staging/load "
            f"{self.startup_s:.0f} s; {self.samples} job(s))"
        )


def estimate(samples: Sequence[ColdStartSample]) -> ColdStartEstimate | None:
    if not samples:
        return None
    totals = sorted(s.total_s for s in samples)
    return ColdStartEstimate(
        queue_s=_median([s.queue_s for s in samples]),
        startup_s=_median([s.startup_s for s in samples]),
        total_p90_s=totals[min(len(totals) - 1, math.ceil(0.9 * len(totals)) - 1)],
        samples=len(samples),
    )


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


class ColdStarts:
    def __init__(self, state_dir: Path, registry: CollectorRegistry | None = None) -> None:
        self.path = Path(state_dir) / COLD_STARTS_FILE
        self.samples: dict[str, list[ColdStartSample]] = self._load()
        self._serving: set[int] = set()  # jobs seen serving (measured, or kept out) last poll
        self._gauge = Gauge(
            "hpcserve_poolmgr_cold_start_seconds",
            "A pool's measured cold start: median queue wait (part queue), median staging "
            "and load until registration (part startup), p90 of their sum (part total_p90)",
            ["pool", "part"],
            registry=registry,
        )
        for pool in self.samples:
            self._export(pool)

    def _load(self) -> dict[str, list[ColdStartSample]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as err:
            log.warning("cannot read %s, cold starts start from nothing: %s", self.path, err)
            return {}
        try:
            return msgspec.json.decode(data, type=dict[str, list[ColdStartSample]])
        except msgspec.DecodeError as err:
            log.warning("%s is not a cold-start record, ignored: %s", self.path, err)
            return {}

    def estimate(self, pool: str) -> ColdStartEstimate | None:
        return estimate(self.samples.get(pool, []))

    def leads(self) -> dict[str, float]:
        """Pool -> its cold start's p90, for the pools measured."""
        return {
            pool: est.total_p90_s
            for pool in self.samples
            if (est := self.estimate(pool)) is not None
        }

    def observe(
        self,
        ours: Iterable[tuple[SlurmJob, JobIdentity]],
        replicas: Sequence[ReplicaInfo],
        now: float,
    ) -> list[ColdStartSample]:
        """Measure the jobs of ours that serve and were not measured yet; returns the new
        measurements (each logged once)."""
        registered = {r.slurm_job_id: now - r.age_s for r in replicas if r.slurm_job_id}
        measured = {s.job_id for samples in self.samples.values() for s in samples}
        measured |= self._serving
        new: list[tuple[str, ColdStartSample]] = []
        ours = list(ours)
        self._serving = {job.job_id for job, _ in ours if job.job_id in registered}
        for job, ident in ours:
            at = registered.get(job.job_id)
            if at is None or job.job_id in measured or not job.start_time:
                continue
            sample = ColdStartSample(
                job_id=job.job_id,
                queue_s=float(max(job.start_time - job.submit_time, 0)),
                startup_s=round(max(at - job.start_time, 0.0), 1),
                at=now,
            )
            new.append((ident.pool, sample))
        for pool, sample in new:
            kept = [*self.samples.get(pool, []), sample][-KEEP:]
            self.samples[pool] = kept
            self._export(pool)
            log.info(
                "pool %s: job %d cold start %.0f s (queue %.0f s, staging/load %.0f s); "
                "pool's cold start now %s",
                pool, sample.job_id, sample.total_s, sample.queue_s, sample.startup_s,
                estimate(kept).describe(),  # type: ignore[union-attr]
            )  # fmt: skip
        if new:
            try:
                write_atomic(self.path, msgspec.json.encode(self.samples))
            except OSError as err:
                log.warning("cannot write %s: %s", self.path, err)
        return [sample for _, sample in new]

    def _export(self, pool: str) -> None:
        est = self.estimate(pool)
        if est is None:
            return
        self._gauge.labels(pool, "queue").set(est.queue_s)
        self._gauge.labels(pool, "startup").set(est.startup_s)
        self._gauge.labels(pool, "total_p90").set(est.total_p90_s)
