"""Each job's state at the previous poll, and the transitions one poll shows.

The one place the pool manager remembers job states between polls: the state-change log
lines and the failure count (failures.py) both read the transitions from here. A job that
squeue no longer lists is forgotten; its outcome was seen (or never will be).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hpcserve.poolmgr.identity import JobIdentity
from hpcserve.slurm.parse import JobState, SlurmJob


@dataclass(frozen=True)
class Transition:
    job: SlurmJob
    identity: JobIdentity
    # The job's state at the previous poll; None for a job seen for the first time.
    before: JobState | None

    @property
    def changed(self) -> bool:
        return self.before is not self.job.state


class JobStates:
    def __init__(self) -> None:
        self._last: dict[int, JobState] = {}

    def observe(self, ours: Iterable[tuple[SlurmJob, JobIdentity]]) -> list[Transition]:
        """One poll's jobs, each with its state at the previous poll."""
        transitions = [Transition(job, ident, self._last.get(job.job_id)) for job, ident in ours]
        self._last = {t.job.job_id: t.job.state for t in transitions}
        return transitions
