"""Taking GPUs when the partition is full (poolmgr/gpu_take.py): which pool gives a replica
to an autoscaled pool waiting for GPUs, as a table; and the pool manager's use of it
(poolmgr/autoscale_pools.py): the donor's target, log line, metric and no growing back."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import parse_config
from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.autoscale_pools import AutoscaledPools
from hpcserve.poolmgr.gpu_take import Donor, Shape, Waiting, choose
from hpcserve.poolmgr.reconcile import ObservedJob

ONE = Shape("gpu", 1, 1)
NEED = Waiting("chat", priority=10, shape=ONE, waited_s=90, job_id=7, reason="Resources")


def donor(pool: str, priority: int = 0, running: int = 3, floor: int = 1, **kw: object) -> Donor:
    return Donor(pool, priority, kw.pop("shape", ONE), running, floor, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("waiting", "donors", "taken", "target", "why"),
    [
        # The lowest priority first.
        ([NEED], [donor("a", 5), donor("b", 1)], "b", 2, ""),
        # Equal priority: the one furthest above its floor.
        ([NEED], [donor("a", 1, running=2), donor("b", 1, running=4)], "b", 3, ""),
        # Never at or below the floor, never equal or higher priority.
        (
            [NEED],
            [donor("a", 0, running=1), donor("b", 10), donor("c", 12)],
            None,
            0,
            "no pool of lower priority above its floor",
        ),
        # An admin's override, or a pending job of its own: not taken.
        (
            [NEED],
            [donor("a", overridden=True), donor("b", pending=1)],
            None,
            0,
            "no pool of lower priority",
        ),
        # Another partition, or replicas with fewer GPUs than the waiting pool needs.
        ([NEED], [donor("a", shape=Shape("cpu", 1, 1))], None, 0, "no pool of lower priority"),
        (
            [Waiting("chat", 10, Shape("gpu", 4, 1), 90, 7, "Resources")],
            [donor("a")],
            None,
            0,
            "no pool",
        ),
        # An elastic batch pool above its floor yields first (batch_sizing.py), whatever
        # its priority; one at its floor does not stop a take.
        (
            [NEED],
            [donor("batch", 50, batch=True), donor("a")],
            None,
            0,
            "a batch pool yields first",
        ),
        ([NEED], [donor("batch", 50, running=1, batch=True), donor("a")], "a", 2, ""),
        # One at a time: a replica draining for it comes first.
        ([NEED], [donor("a", draining=1), donor("b")], None, 0, "a replica is draining"),
        # Not yet waited long enough, or pending for another reason than GPUs.
        ([Waiting("chat", 10, ONE, 30, 7, "Resources")], [donor("a")], None, 0, ""),
        ([Waiting("chat", 10, ONE, 90, 7, "QOSMaxGRESPerUser")], [donor("a")], None, 0, ""),
        # Two pools waiting: the higher priority is served first.
        ([NEED, Waiting("code", 20, ONE, 60, 8, "Priority")], [donor("a", 5)], "a", 2, ""),
    ],
)
def test_which_pool_gives_a_replica(
    waiting: list[Waiting], donors: list[Donor], taken: str | None, target: int, why: str
) -> None:
    decision = choose(waiting, donors, after_s=60)
    if taken is None:
        assert decision.take is None and why in decision.reason
    else:
        assert decision.take is not None and decision.reason == ""
        assert (decision.take.donor, decision.take.target) == (taken, target)
        assert decision.take.reason.startswith(f"taken for pool {decision.take.waiting} (priority")


def test_the_taken_reason_names_the_waiting_job() -> None:
    decision = choose([NEED], [donor("a", 3)], after_s=60)
    assert decision.take is not None
    assert decision.take.reason == (
        "taken for pool chat (priority 10 > 3): its job 7 has waited 90 s for GPUs (Resources)"
    )


CONFIG = parse_config(
    {
        "poolmgr": {"take_gpus_after_s": 60},
        "pools": [
            {"name": "chat", "model_path": "/m", "replicas": 1, "priority": 10,
             "autoscale": {"max": 4, "target_in_flight": 4, "scale_up_window_s": 0,
                           "scale_up_cooldown_s": 0}},
            {"name": "docs", "model_path": "/m", "served_model_name": "d", "replicas": 3,
             "autoscale": {"min": 1, "max": 4, "target_in_flight": 4, "scale_up_window_s": 0,
                           "scale_up_cooldown_s": 0}},
        ],
    }
)  # fmt: skip


def replica(job_id: int, pool: str, in_flight: int) -> ReplicaInfo:
    return ReplicaInfo(
        replica_id=f"r{job_id}", model=pool, url="http://n:1", pool=pool, slurm_job_id=job_id,
        node="n", age_s=1, last_seen_age_s=0, in_flight=in_flight,
        load=ReplicaLoad(running=in_flight, waiting=0, kv_usage=0.1),
    )  # fmt: skip


def test_a_waiting_pool_takes_a_replica_and_the_donor_does_not_grow_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    pools = AutoscaledPools(registry)
    caplog.set_level(logging.INFO, "hpcserve.poolmgr.autoscale_pools")
    jobs = [ObservedJob(1, "chat", pending=False, submit_time=0, serving=True)]
    jobs += [ObservedJob(i, "docs", pending=False, submit_time=0, serving=True) for i in (2, 3, 4)]
    jobs.append(ObservedJob(5, "chat", pending=True, submit_time=1000))  # chat grew: it waits
    draining: dict[int, float] = {}

    def poll(now: float, reasons: dict[int, str]) -> dict[str, int]:
        docs = [i for i in (2, 3, 4) if i not in draining]  # 12 in flight over them
        listed = [replica(1, "chat", 8), *(replica(i, "docs", 12 // len(docs)) for i in docs)]
        desired = pools.resize(CONFIG, {"chat": 1, "docs": 3}, {}, jobs, draining, listed, {}, now)
        return pools.take_gpus(CONFIG, desired, jobs, draining, reasons, {}, now)

    # docs carries 12 in flight at 4 per replica: steady at 3.
    assert poll(1030.0, {5: "Resources"})["docs"] == 3  # chat has waited 30 s of 60
    assert poll(1059.0, {5: "Priority"})["docs"] == 3
    assert poll(1061.0, {5: "Resources"})["docs"] == 2  # 61 s: a replica is taken
    assert pools.decisions["docs"].direction == "taken"
    taken = [r.getMessage() for r in caplog.records if "taken" in r.getMessage()]
    assert taken == [
        "pool docs: autoscale taken 3->2: taken for pool chat (priority 10 > 0): its job 5 "
        "has waited 61 s for GPUs (Resources)"
    ]
    assert registry.get_sample_value(
        "hpcserve_poolmgr_autoscale_decisions_total", {"pool": "docs", "direction": "taken"}
    ) == 1  # fmt: skip
    draining[4] = 1061.0  # reconcile drains docs' surplus replica
    # Its 12 in flight on 2 replicas want 3 again, but chat still waits: docs holds at 2,
    # says why, and nothing more is taken while that replica drains.
    assert poll(1062.0, {5: "Resources"})["docs"] == 2
    assert pools.decisions["docs"].reason.endswith("pool chat (priority 10) waits for GPUs")
    assert len([r for r in caplog.records if "taken" in r.getMessage()]) == 1
    # The drained job ends and chat's starts: docs may grow again.
    jobs[3] = ObservedJob(5, "chat", pending=False, submit_time=1000, serving=True)
    del jobs[-1]
    draining.clear()
    poll(1063.0, {})
    assert poll(1064.0, {})["docs"] == 3


def test_a_donor_already_shrinking_is_taken_from_what_it_keeps() -> None:
    """docs' own target is already 2 of its 3 running (a drain this poll): a take makes it
    1, never 3 - 1 = 2 again, nor more than its target."""
    pools = AutoscaledPools(CollectorRegistry())
    jobs = [ObservedJob(i, "docs", pending=False, submit_time=0, serving=True) for i in (2, 3, 4)]
    jobs.append(ObservedJob(5, "chat", pending=True, submit_time=0))
    out = pools.take_gpus(CONFIG, {"chat": 1, "docs": 2}, jobs, {}, {5: "Resources"}, {}, 100.0)
    assert out["docs"] == 1
