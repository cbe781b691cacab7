"""The pool manager's own job records (poolmgr/job_records.py, contracts/job_records.py), and
`hpcserve report` falling back to them where sacct has no accounting."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpcserve.config import PlatformConfig, parse_config
from hpcserve.contracts.job_records import FILE_NAME, read_job_records
from hpcserve.poolmgr.identity import new_identity
from hpcserve.poolmgr.job_records import JobRecords
from hpcserve.poolmgr.job_states import JobStates
from hpcserve.report.cli import make_report
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob

T0 = 1_780_012_800.0


def _config(tmp_path: Path) -> PlatformConfig:
    return parse_config(
        {
            "state_dir": str(tmp_path),
            "cost": {"gpu_hour_price": 2.0},
            "pools": [
                {"name": "chat", "served_model_name": "chat", "model_path": "/m",
                 "engine": "sim", "gpus_per_replica": 2},
            ],
        }
    )  # fmt: skip


def _job(job_id: int, state: JobState, end: float | None = None) -> SlurmJob:
    start = int(T0) if state is not JobState.PENDING else None
    return SlurmJob(
        job_id, "hpcserve-chat", state, "None", ["n1"] if start else [], "gpu", "", 0,
        start, 3600, int(end) if end else None, "",
    )  # fmt: skip


IDENT = new_identity("chat", "chat")


def test_a_line_when_a_job_runs_and_one_when_it_ends(tmp_path: Path) -> None:
    config, states, records = _config(tmp_path), JobStates(), JobRecords(tmp_path)

    def poll(now: float, *jobs: SlurmJob) -> None:
        records.update(config, states.observe([(j, IDENT) for j in jobs]), now)

    poll(T0 - 5, _job(1, JobState.PENDING))
    poll(T0 + 1, _job(1, JobState.RUNNING), _job(2, JobState.RUNNING))
    poll(T0 + 2, _job(1, JobState.RUNNING), _job(2, JobState.RUNNING))  # nothing new
    assert len((tmp_path / FILE_NAME).read_text().splitlines()) == 2
    poll(T0 + 900, _job(1, JobState.COMPLETED, end=T0 + 600))  # job 2 gone unseen
    assert len((tmp_path / FILE_NAME).read_text().splitlines()) == 4
    done = {r.job_id: r for r in read_job_records(tmp_path / FILE_NAME)}
    assert (done[1].start, done[1].end, done[1].gpus, done[1].state) == (
        T0,
        T0 + 600,
        2,
        "COMPLETED",
    )
    assert (done[2].end, done[2].state) == (T0 + 900, "UNKNOWN")
    assert oct((tmp_path / FILE_NAME).stat().st_mode & 0o777) == "0o600"


def test_a_restart_closes_jobs_that_ended_unseen_at_their_limit(tmp_path: Path) -> None:
    config = _config(tmp_path)
    first = JobRecords(tmp_path)
    first.update(config, JobStates().observe([(_job(3, JobState.RUNNING), IDENT)]), T0 + 10)
    # The pool manager was down when job 3 ended; squeue forgot it. Job 4 still runs.
    again = JobRecords(tmp_path)
    again.update(config, JobStates().observe([(_job(4, JobState.RUNNING), IDENT)]), T0 + 86400)
    done = {r.job_id: r for r in read_job_records(tmp_path / FILE_NAME)}
    assert (done[3].end, done[3].state) == (T0 + 3600, "UNKNOWN")
    assert done[4].end == 0.0


class _NoAccounting:
    def __call__(self, argv: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        stderr = "sacct: error: Slurm accounting storage is disabled\n"
        return subprocess.CompletedProcess(argv, 1, "", stderr)


def test_the_report_says_it_took_the_job_records_when_sacct_has_none(tmp_path: Path) -> None:
    config, states, records = _config(tmp_path), JobStates(), JobRecords(tmp_path)
    records.update(config, states.observe([(_job(5, JobState.RUNNING), IDENT)]), T0 + 1)
    done = _job(5, JobState.COMPLETED, end=T0 + 1800)
    records.update(config, states.observe([(done, IDENT)]), T0 + 1801)
    report = make_report(config, T0, T0 + 86400, client=SlurmCLI({}, runner=_NoAccounting()))
    assert report.gpu_hours_source.startswith("the pool manager's job records")
    assert "accounting storage is disabled" in report.gpu_hours_source
    (chat,) = report.pools
    assert (chat.gpu_hours, chat.cost) == (pytest.approx(1.0), pytest.approx(2.0))


def test_without_either_the_report_has_no_gpu_hours(tmp_path: Path) -> None:
    report = make_report(
        _config(tmp_path), T0, T0 + 60, client=SlurmCLI({}, runner=_NoAccounting())
    )
    assert report.gpu_hours_source.startswith("none: sacct failed")
    assert report.total.cost is None
