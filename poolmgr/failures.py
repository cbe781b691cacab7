"""Which pools are failing, and why: read from job state transitions (job_states.py; pure,
clock passed in).

A job of a pool that ends in a failure state (FAILED, NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL,
TIMEOUT, DEADLINE) counts one failure against the pool; the reason keeps Slurm's own words.
A job cancelled by anyone, preempted by Slurm (a batch job whose GPUs an interactive one
took), or one that completes (a drained replica), is no failure. A replica that has served
for `healthy_after_s` clears its pool's count: the pool works again. The count drives the
submission backoff in reconcile.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpcserve.poolmgr.job_states import Transition
from hpcserve.slurm.parse import JobState

FAILURE_STATES = frozenset({
    JobState.FAILED, JobState.NODE_FAIL, JobState.OUT_OF_MEMORY, JobState.BOOT_FAIL,
    JobState.TIMEOUT, JobState.DEADLINE,
})  # fmt: skip


class FailureTracker:
    def __init__(self, healthy_after_s: float) -> None:
        self.healthy_after_s = healthy_after_s
        self.failures: dict[str, int] = {}
        self.last_failure: dict[str, str] = {}
        self._serving_since: dict[int, float] = {}

    def update(
        self, transitions: Iterable[Transition], serving_job_ids: set[int], now: float
    ) -> list[str]:
        """Take one poll's transitions; returns a line per new failure (for the log)."""
        events = []
        listed: set[int] = set()
        for transition in transitions:
            job, ident, before = transition.job, transition.identity, transition.before
            listed.add(job.job_id)
            if job.state in FAILURE_STATES and (before is None or before.is_active):
                self.failures[ident.pool] = self.failures.get(ident.pool, 0) + 1
                where = f" on {','.join(job.nodes)}" if job.nodes else ""
                reason = f" ({job.state_reason})" if job.state_reason not in ("", "None") else ""
                self.last_failure[ident.pool] = f"job {job.job_id} {job.state.value}{where}{reason}"
                events.append(
                    f"pool {ident.pool}: {self.last_failure[ident.pool]}, "
                    f"failure {self.failures[ident.pool]} in a row"
                )
            if job.job_id in serving_job_ids:
                since = self._serving_since.setdefault(job.job_id, now)
                if now - since >= self.healthy_after_s and self.failures.get(ident.pool):
                    self.failures[ident.pool] = 0
            else:
                self._serving_since.pop(job.job_id, None)
        self._serving_since = {k: v for k, v in self._serving_since.items() if k in listed}
        return events
