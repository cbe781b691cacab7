from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.identity import JobIdentity
from hpcserve.poolmgr.observe import observe
from hpcserve.slurm.parse import JobState, SlurmJob, SlurmNode


def slurm_job(
    job_id: int,
    state: JobState = JobState.RUNNING,
    pool: str = "chat",
    spec: str = "aaaa",
    nodes: tuple[str, ...] = ("n1",),
    comment: str | None = None,
    start: int = 1000,
    limit: int | None = 3600,
) -> SlurmJob:
    ident = JobIdentity(pool, "m", f"{job_id:04x}", spec)
    return SlurmJob(
        job_id=job_id,
        name="hpcserve-" + pool,
        state=state,
        state_reason="None",
        nodes=list(nodes),
        partition="gpu",
        comment=ident.comment() if comment is None else comment,
        submit_time=start - 10,
        start_time=start,
        time_limit_s=limit,
        end_time=None,
        batch_host=nodes[0] if nodes else "",
    )


def replica(job_id: int, pool: str = "chat") -> ReplicaInfo:
    return ReplicaInfo(
        f"r{job_id}", "m", "http://x", pool, job_id, "n1", 1.0, 0.1, 0, ReplicaLoad()
    )


def node(name: str, *state: str) -> SlurmNode:
    return SlurmNode(
        name=name,
        state=list(state),
        reason="",
        gres="gpu:4",
        gres_used="",
        cpus=4,
        alloc_cpus=0,
        partitions=["gpu"],
    )


def test_observe_maps_replicas_to_jobs_and_finds_admin_capacity():
    jobs = [
        slurm_job(1),
        slurm_job(2, state=JobState.PENDING, nodes=()),
        slurm_job(3, state=JobState.FAILED),  # ended: reported in ours, not in jobs
        slurm_job(4, comment="an admin's own job"),
        slurm_job(5, nodes=("n2",), spec="bbbb"),
    ]
    replicas = [replica(1), replica(4), replica(0), replica(9, pool="unconfigured")]
    seen = observe(
        jobs, replicas, [node("n1", "IDLE"), node("n2", "MIXED", "DRAIN")], {"chat": "aaaa"}
    )
    assert [j.job_id for j, _ in seen.ours] == [1, 2, 3, 5]
    by_id = {j.job_id: j for j in seen.jobs}
    assert sorted(by_id) == [1, 2, 5]
    assert by_id[1].serving and not by_id[2].serving and by_id[2].pending
    assert by_id[1].ends_at == 4600.0 and by_id[2].ends_at is None
    assert by_id[5].on_bad_node and by_id[5].stale_spec
    assert not by_id[1].on_bad_node and not by_id[1].stale_spec
    # Replicas from jobs hpcserve did not submit (an admin's job, a process outside Slurm)
    # count for their pool; ones of unconfigured pools do not.
    assert seen.admin_serving == {"chat": 2}
