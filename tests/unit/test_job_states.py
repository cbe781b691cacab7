"""Job state transitions between polls (poolmgr/job_states.py) and the failure count read
from them (poolmgr/failures.py)."""

import pytest

from hpcserve.poolmgr.failures import FailureTracker
from hpcserve.poolmgr.identity import JobIdentity
from hpcserve.poolmgr.job_states import JobStates
from hpcserve.slurm.parse import JobState, SlurmJob

R, P, F, C = JobState.RUNNING, JobState.PENDING, JobState.FAILED, JobState.CANCELLED


def ours(*jobs: tuple[int, JobState]) -> list[tuple[SlurmJob, JobIdentity]]:
    return [
        (
            SlurmJob(
                job_id=job_id, name="hpcserve-chat", state=state, state_reason="None",
                nodes=["n1"], partition="gpu", comment="", submit_time=0, start_time=0,
                time_limit_s=None, end_time=None, batch_host="n1",
            ),
            JobIdentity("chat", "m", f"{job_id:04x}"),
        )
        for job_id, state in jobs
    ]  # fmt: skip


def test_transitions_carry_the_previous_polls_state_and_forget_unlisted_jobs() -> None:
    states = JobStates()
    first = states.observe(ours((1, P), (2, R)))
    assert [(t.job.job_id, t.before, t.changed) for t in first] == [
        (1, None, True),
        (2, None, True),
    ]
    second = states.observe(ours((1, R), (2, R)))
    assert [(t.before, t.changed) for t in second] == [(P, True), (R, False)]
    states.observe(ours((1, R)))  # job 2 left squeue
    assert [t.before for t in states.observe(ours((1, F), (2, R)))] == [R, None]


@pytest.mark.parametrize(
    ("polls", "failures"),
    [
        ([[(1, R)], [(1, F)]], 1),  # a running job fails
        ([[(1, F)]], 1),  # first seen failed
        ([[(1, R)], [(1, F)], [(1, F)]], 1),  # counted once, not at every poll
        ([[(1, R)], [(1, C)]], 0),  # cancelled is no failure
        ([[(1, F)], [], [(1, F)]], 2),  # forgotten once unlisted, so seen anew
        ([[(1, R), (2, P)], [(1, F), (2, F)]], 2),
    ],
)
def test_failures_count_transitions_into_a_failure_state(
    polls: list[list[tuple[int, JobState]]], failures: int
) -> None:
    states, tracker = JobStates(), FailureTracker(healthy_after_s=60)
    for poll in polls:
        tracker.update(states.observe(ours(*poll)), serving_job_ids=set(), now=0.0)
    assert tracker.failures.get("chat", 0) == failures


def test_a_replica_serving_long_enough_clears_the_count() -> None:
    states, tracker = JobStates(), FailureTracker(healthy_after_s=60)
    lines = tracker.update(states.observe(ours((1, F), (2, R))), {2}, now=0.0)
    assert lines == ["pool chat: job 1 FAILED on n1, failure 1 in a row"]
    tracker.update(states.observe(ours((2, R))), {2}, now=59.0)
    assert tracker.failures["chat"] == 1
    tracker.update(states.observe(ours((2, R))), {2}, now=60.0)
    assert tracker.failures["chat"] == 0
    assert tracker.last_failure["chat"] == "job 1 FAILED on n1"
