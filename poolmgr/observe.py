"""Turn what Slurm and the router report into the reconcile step's inputs (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.poolmgr.identity import JobIdentity, parse_comment
from hpcserve.poolmgr.reconcile import ObservedJob
from hpcserve.slurm.parse import JobState, SlurmJob, SlurmNode


@dataclass(frozen=True)
class Observation:
    ours: list[tuple[SlurmJob, JobIdentity]]  # every hpcserve job squeue shows, ended ones too
    jobs: list[ObservedJob]  # the active ones, as reconcile sees them
    admin_serving: dict[str, int]  # replicas per pool from jobs hpcserve did not submit
    serving_job_ids: set[int]


def observe(
    slurm_jobs: Sequence[SlurmJob],
    replicas: Sequence[ReplicaInfo],
    nodes: Sequence[SlurmNode],
    spec_digests: Mapping[str, str],
) -> Observation:
    """spec_digests: the current digest of each configured pool."""
    ours = [(job, ident) for job in slurm_jobs if (ident := parse_comment(job.comment))]
    our_ids = {job.job_id for job, _ in ours}
    bad_nodes = {node.name for node in nodes if node.drained or node.down}
    serving = {r.slurm_job_id for r in replicas if r.slurm_job_id}
    admin: dict[str, int] = {}
    for replica in replicas:
        if replica.pool in spec_digests and replica.slurm_job_id not in our_ids:
            admin[replica.pool] = admin.get(replica.pool, 0) + 1
    jobs = []
    for job, ident in ours:
        if not job.state.is_active:
            continue
        current = spec_digests.get(ident.pool)
        ends_at = (
            job.start_time + job.time_limit_s
            if job.start_time and job.time_limit_s and job.state is not JobState.PENDING
            else None
        )
        jobs.append(ObservedJob(
            job_id=job.job_id,
            pool=ident.pool,
            pending=job.state is JobState.PENDING,
            submit_time=job.submit_time,
            serving=job.job_id in serving,
            ends_at=float(ends_at) if ends_at else None,
            on_bad_node=any(n in bad_nodes for n in job.nodes),
            stale_spec=bool(current and ident.spec and ident.spec != current),
        ))  # fmt: skip
    return Observation(ours=ours, jobs=jobs, admin_serving=admin, serving_job_ids=serving)
