"""Each pool's cold start from its own jobs (poolmgr/cold_start.py): queue wait from Slurm's
times, staging and load until the router lists the replica; kept in the state dir across
restarts, exported as a metric, shown by `hpcserve status`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.cold_start import (
    COLD_STARTS_FILE,
    KEEP,
    ColdStarts,
    ColdStartSample,
    estimate,
)
from hpcserve.poolmgr.identity import JobIdentity
from hpcserve.poolmgr.state_files import PoolStatus
from hpcserve.slurm.parse import JobState, SlurmJob
from hpcserve.status import format_status


def job(
    job_id: int, submit: int, start: int | None, pool: str = "chat"
) -> tuple[SlurmJob, JobIdentity]:
    state = JobState.RUNNING if start else JobState.PENDING
    return (
        SlurmJob(job_id=job_id, name="hs-" + pool, state=state, state_reason="None", nodes=[],
                 partition="gpu", comment="", submit_time=submit, start_time=start,
                 time_limit_s=3600, end_time=None, batch_host=""),
        JobIdentity(pool=pool, model=pool, nonce="n"),
    )  # fmt: skip


def replica(job_id: int, age_s: float) -> ReplicaInfo:
    return ReplicaInfo(replica_id=f"r{job_id}", model="chat", url="http://n:1", pool="chat",
                       slurm_job_id=job_id, node="n", age_s=age_s, last_seen_age_s=0,
                       in_flight=0, load=ReplicaLoad())  # fmt: skip


def gauge(registry: CollectorRegistry, part: str, pool: str = "chat") -> float | None:
    return registry.get_sample_value(
        "hpcserve_poolmgr_cold_start_seconds", {"pool": pool, "part": part}
    )


def test_each_job_is_measured_once_when_it_serves_and_kept_across_restarts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hpcserve.poolmgr.cold_start")
    registry = CollectorRegistry()
    book = ColdStarts(tmp_path, registry)
    # Pending, or running and not registered yet: nothing to measure.
    assert book.observe([job(1, 1000, None), job(2, 1000, 1010)], [], now=1050) == []
    # Job 2: queued 10 s; started at 1010, registered 60 s before now (1130): 60 s start-up.
    (sample,) = book.observe([job(2, 1000, 1010)], [replica(2, age_s=60)], now=1130)
    assert (sample.job_id, sample.queue_s, sample.startup_s) == (2, 10, 60)
    assert book.observe([job(2, 1000, 1010)], [replica(2, age_s=80)], now=1150) == []  # once
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "pool chat: job 2 cold start 70 s (queue 10 s, staging/load 60 s); pool's cold start "
        "now 70 s p90 (median queue 10 s + staging/load 60 s; 1 job(s))"
    )
    assert (gauge(registry, "queue"), gauge(registry, "startup"), gauge(registry, "total_p90")) == (
        10,
        60,
        70,
    )
    # A new pool manager (a restart) reads what was measured: same estimate, same gauges.
    again = CollectorRegistry()
    restarted = ColdStarts(tmp_path, again)
    assert restarted.estimate("chat") == book.estimate("chat")
    assert gauge(again, "total_p90") == 70 and restarted.leads() == {"chat": 70}
    # ... and does not measure job 2 a second time.
    assert restarted.observe([job(2, 1000, 1010)], [replica(2, age_s=90)], now=1160) == []


def test_the_estimate_is_medians_and_the_p90_of_the_last_measurements(tmp_path: Path) -> None:
    samples = [ColdStartSample(i, queue_s=q, startup_s=30, at=0) for i, q in
               enumerate([0, 10, 20, 30, 40, 50, 60, 70, 80, 600])]  # fmt: skip
    est = estimate(samples)
    assert est is not None
    assert (est.queue_s, est.startup_s, est.total_p90_s, est.samples) == (45, 30, 110, 10)
    assert estimate([]) is None
    book = ColdStarts(tmp_path)
    for i in range(KEEP + 5):
        book.observe([job(i, 0, 5)], [replica(i, age_s=0)], now=25)
    assert len(book.samples["chat"]) == KEEP and book.samples["chat"][0].job_id == 5


def test_an_unreadable_record_starts_from_nothing(tmp_path: Path) -> None:
    (tmp_path / COLD_STARTS_FILE).write_text("{not json")
    assert ColdStarts(tmp_path).samples == {}


def test_status_shows_the_cold_start() -> None:
    row = {"pool": "chat", "model": "chat", "cold_start": "70 s p90 (median queue 10 s + "
           "staging/load 60 s; 1 job(s))"}  # fmt: skip
    text = format_status({"pools": [row], "jobs": [], "replicas": [], "nodes": [], "errors": []})
    assert "  chat: cold start 70 s p90 (median queue 10 s + staging/load 60 s; 1 job(s))" in (
        text.splitlines()
    )
    assert PoolStatus("chat", "chat", 1, 1, 1, 0, 0, 0).cold_start == ""
