import pytest

from hpcserve.poolmgr.reconcile import (
    Cancel,
    Drain,
    ObservedJob,
    PoolMemory,
    Submit,
    reconcile,
)


def job(job_id: int, pool: str = "chat", pending: bool = False, submit: int = 0) -> ObservedJob:
    return ObservedJob(job_id, pool, pending, submit or job_id)


def plan(desired, jobs, memory=None, now=100.0):
    return reconcile(
        desired,
        jobs,
        memory or PoolMemory(),
        now=now,
        min_submit_interval_s=10,
        drain_deadline_s=120,
    )


@pytest.mark.parametrize(
    ("desired", "jobs", "expected"),
    [
        ({"chat": 2}, [], [Submit("chat", 2)]),
        ({"chat": 2}, [job(1)], [Submit("chat", 1)]),
        ({"chat": 1}, [job(1)], []),
        ({"chat": 0}, [job(1)], [Drain(1, "chat")]),
        # Pending jobs go before running ones; among running ones the newest goes first.
        ({"chat": 1}, [job(1), job(2, pending=True)], [Cancel(2, "chat", "scale down")]),
        ({"chat": 1}, [job(1), job(3), job(2)], [Drain(3, "chat"), Drain(2, "chat")]),
        ({"chat": 1, "embed": 1}, [job(1)], [Submit("embed", 1)]),
    ],
)
def test_reconcile_table(desired, jobs, expected):
    assert plan(desired, jobs).actions == expected


def test_submissions_are_rate_limited_per_pool():
    memory = PoolMemory(last_submit={"chat": 95.0})
    assert plan({"chat": 1, "embed": 1}, [], memory).actions == [Submit("embed", 1)]
    assert plan({"chat": 1}, [], memory, now=105.0).actions == [Submit("chat", 1)]


def test_draining_jobs_do_not_count_and_are_cancelled_after_the_deadline():
    memory = PoolMemory(draining_since={1: 50.0})
    assert plan({"chat": 1}, [job(1)], memory, now=100.0).actions == [Submit("chat", 1)]
    late = plan({"chat": 0}, [job(1)], memory, now=171.0).actions
    assert late == [Cancel(1, "chat", "drain took over 120s")]


def test_jobs_of_unknown_pools_are_left_alone_and_reported():
    result = plan({"chat": 1}, [job(1), job(2, pool="old")])
    assert result.actions == [] and result.unmanaged_pools == ["old"]
