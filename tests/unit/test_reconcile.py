import pytest

from hpcserve.poolmgr.reconcile import (
    Cancel,
    Drain,
    ObservedJob,
    PoolMemory,
    Submit,
    Timing,
    reconcile,
    retire_reason,
)

TIMING = Timing(
    min_submit_interval_s=10, drain_deadline_s=120, handover_lead_s=300, max_backoff_s=100
)


def job(
    job_id: int,
    pool: str = "chat",
    pending: bool = False,
    submit: int = 0,
    serving: bool | None = None,
    **kw: object,
) -> ObservedJob:
    return ObservedJob(
        job_id,
        pool,
        pending,
        submit or job_id,
        serving=(not pending) if serving is None else serving,
        **kw,
    )


def plan(desired, jobs, memory=None, now=1000.0, admin=None):
    return reconcile(
        desired, jobs, memory or PoolMemory(), now=now, timing=TIMING, admin_serving=admin
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
        # A running job that does not serve yet goes before serving ones, and needs no drain.
        ({"chat": 1}, [job(1), job(2, serving=False)], [Cancel(2, "chat", "scale down")]),
        ({"chat": 1, "embed": 1}, [job(1)], [Submit("embed", 1)]),
    ],
)
def test_reconcile_table(desired, jobs, expected):
    assert plan(desired, jobs).actions == expected


@pytest.mark.parametrize(
    ("desired", "jobs", "admin", "expected"),
    [
        # An admin's replica counts towards the pool...
        ({"chat": 2}, [job(1)], {"chat": 1}, []),
        ({"chat": 2}, [], {"chat": 1}, [Submit("chat", 1)]),
        # ...and shrinking the pool never touches it: only hpcserve's jobs are removed.
        ({"chat": 1}, [job(1)], {"chat": 1}, [Drain(1, "chat")]),
        ({"chat": 0}, [], {"chat": 2}, []),
        ({"chat": 1}, [job(1), job(2)], {"chat": 3}, [Drain(2, "chat"), Drain(1, "chat")]),
    ],
)
def test_admin_capacity(desired, jobs, admin, expected):
    assert plan(desired, jobs, admin=admin).actions == expected


def test_submissions_back_off_exponentially_with_failures():
    memory = PoolMemory(last_submit={"chat": 1000.0}, failures={"chat": 3})
    result = plan({"chat": 1}, [], memory, now=1050.0)
    assert result.actions == [] and result.next_submit_at == {"chat": 1080.0}  # 10 x 2^3
    assert plan({"chat": 1}, [], memory, now=1080.0).actions == [Submit("chat", 1)]
    memory.failures["chat"] = 10  # capped at max_backoff_s
    assert plan({"chat": 1}, [], memory, now=1100.0).actions == [Submit("chat", 1)]
    fresh = PoolMemory(last_submit={"chat": 995.0})
    assert plan({"chat": 1, "embed": 1}, [], fresh).actions == [Submit("embed", 1)]


@pytest.mark.parametrize(
    ("observed", "reason"),
    [
        (job(1, ends_at=1200.0), "time limit near"),
        (job(1, ends_at=1400.0), ""),
        (job(1, pending=True, ends_at=1200.0), ""),
        (job(1, on_bad_node=True), "node drained or down"),
        (job(1, stale_spec=True), "pool spec changed"),
    ],
)
def test_retire_reason(observed, reason):
    assert retire_reason(observed, now=1000.0, handover_lead_s=300) == reason


def test_walltime_handover_submits_a_successor_then_drains_the_old_job():
    old = job(1, ends_at=1200.0)
    # The old job nears its limit: a successor is submitted, the old one keeps serving.
    assert plan({"chat": 1}, [old]).actions == [Submit("chat", 1)]
    # The successor is starting: nothing to do yet.
    assert plan({"chat": 1}, [old, job(2, serving=False)]).actions == []
    # The successor serves: the old job drains.
    assert plan({"chat": 1}, [old, job(2)]).actions == [Drain(1, "chat", "time limit near")]


def test_replicas_on_bad_nodes_and_stale_specs_are_replaced():
    assert plan({"chat": 1}, [job(1, on_bad_node=True), job(2)]).actions == [
        Drain(1, "chat", "node drained or down")
    ]
    assert plan({"chat": 1}, [job(1, stale_spec=True, serving=False)]).actions == [
        Submit("chat", 1),
        Cancel(1, "chat", "pool spec changed"),
    ]


def test_draining_jobs_do_not_count_and_are_cancelled_after_the_deadline():
    memory = PoolMemory(draining_since={1: 950.0})
    assert plan({"chat": 1}, [job(1)], memory, now=1000.0).actions == [Submit("chat", 1)]
    late = plan({"chat": 0}, [job(1)], memory, now=1071.0).actions
    assert late == [Cancel(1, "chat", "drain took over 120s")]


def test_jobs_of_unknown_pools_are_left_alone_and_reported():
    result = plan({"chat": 1}, [job(1), job(2, pool="old")])
    assert result.actions == [] and result.unmanaged_pools == ["old"]
