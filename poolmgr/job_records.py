"""Appends the pool manager's job records (contracts/job_records.py): a line when one of its
jobs is first seen running, one when it ended, for `hpcserve report` where Slurm keeps no
accounting. One write(2) per event (a few per job), from the poll loop.

At its first poll the pool manager also closes what an earlier run left open: a job still
open in the file that squeue no longer lists ended unseen; its end is bounded by its time
limit (the report reads it so), and a line says it ended at the latest then.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from hpcserve.config import PlatformConfig
from hpcserve.contracts.job_records import FILE_NAME, JobRecord, encode, read_job_records
from hpcserve.contracts.private_files import open_private_append
from hpcserve.poolmgr.job_states import Transition
from hpcserve.slurm.parse import JobState

log = logging.getLogger(__name__)


class JobRecords:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._open: dict[int, JobRecord] | None = None  # read at the first update
        self._failed = False

    def update(self, config: PlatformConfig, transitions: Sequence[Transition], now: float) -> None:
        if self._open is None:
            self._open = {r.job_id: r for r in read_job_records(self.path) if not r.end}
            listed = {t.job.job_id for t in transitions}
            for unseen in [r for r in self._open.values() if r.job_id not in listed]:
                limit = unseen.start + unseen.time_limit_s if unseen.time_limit_s else now
                self._write(_ended(unseen, min(now, limit), "UNKNOWN"))
                del self._open[unseen.job_id]
        pools = {pool.name: pool for pool in config.pools}
        for t in transitions:
            job, identity = t.job, t.identity
            record = self._open.get(job.job_id)
            if record is None and job.state is JobState.RUNNING and job.start_time:
                pool = pools.get(identity.pool)
                nodes = len(job.nodes) or (pool.nodes_per_replica if pool else 1)
                record = JobRecord(
                    job_id=job.job_id,
                    name=job.name,
                    pool=identity.pool,
                    partition=job.partition,
                    gpus=(pool.gpus_per_replica if pool else 0) * nodes,
                    nodes=nodes,
                    start=float(job.start_time),
                    time_limit_s=float(job.time_limit_s or 0),
                    state=job.state.value,
                )
                self._open[job.job_id] = record
                self._write(record)
            elif record is not None and not job.state.is_active:
                end = float(job.end_time) if job.end_time else now
                self._write(_ended(record, min(end, now), job.state.value))
                del self._open[job.job_id]
        listed = {t.job.job_id for t in transitions}
        for job_id in [j for j in self._open if j not in listed]:  # gone between two polls
            self._write(_ended(self._open.pop(job_id), now, "UNKNOWN"))

    def _write(self, record: JobRecord) -> None:
        try:
            fd = open_private_append(self.path)
            try:
                os.write(fd, encode(record))
            finally:
                os.close(fd)
        except OSError as err:
            if not self._failed:
                self._failed = True
                log.error("cannot write the job records %s: %s", self.path, err)
            return
        self._failed = False


def _ended(record: JobRecord, end: float, state: str) -> JobRecord:
    return JobRecord(
        job_id=record.job_id,
        name=record.name,
        pool=record.pool,
        partition=record.partition,
        gpus=record.gpus,
        nodes=record.nodes,
        start=record.start,
        end=max(end, record.start),
        time_limit_s=record.time_limit_s,
        state=state,
    )
