"""One reconcile step: desired replicas per pool vs what Slurm and the router report ->
actions (pure).

The pool manager calls `reconcile` once per poll with what it observed and acts on the
result; nothing here talks to Slurm or reads a clock, so every rule is a table test.

Terms: a job is *live* when it is active in Slurm, not draining and not retiring. A job is
*retiring* when it must be replaced: its time limit is within `handover_lead_s`, its node is
DRAIN/DOWN in Slurm, or it was submitted with a pool spec that the config no longer has.
*Admin capacity* is replicas of the pool that registered with the router from jobs hpcserve
did not submit (an admin's own `sbatch`): they count towards the pool, and are never
cancelled.

Rules:
- capacity = live jobs + admin replicas; below desired, submit the shortfall, at most once
  per backoff interval: `min_submit_interval_s x 2^failures`, capped at `max_backoff_s`, so a
  crash loop cannot flood slurmctld;
- above desired, remove surplus hpcserve jobs (never admin ones): pending first (cancelled
  outright), then ones not serving yet, then the newest; running ones are drained (USR1 to
  the batch shell: they leave routing, finish in-flight requests and end by themselves);
- a retiring job is drained once the pool serves its desired size without it (its successor
  is up), or cancelled outright if it is not serving anyway;
- a draining job that outlives its drain deadline is cancelled outright;
- jobs of pools that are not configured are left alone and reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ObservedJob:
    job_id: int
    pool: str
    pending: bool
    submit_time: int
    serving: bool = False  # a replica of this job is registered with the router
    ends_at: float | None = None  # epoch seconds of its time limit, if known
    on_bad_node: bool = False  # its node is DRAIN or DOWN in Slurm
    stale_spec: bool = False  # submitted for a pool spec the config no longer has


@dataclass(frozen=True)
class Submit:
    pool: str
    count: int


@dataclass(frozen=True)
class Drain:
    job_id: int
    pool: str
    reason: str = "scale down"


@dataclass(frozen=True)
class Cancel:
    job_id: int
    pool: str
    reason: str


Action = Submit | Drain | Cancel


@dataclass
class PoolMemory:
    """What the pool manager remembers between steps (rebuilt empty after a restart)."""

    last_submit: dict[str, float] = field(default_factory=dict)
    draining_since: dict[int, float] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Timing:
    min_submit_interval_s: float
    drain_deadline_s: float
    handover_lead_s: float = 0.0
    max_backoff_s: float = 600.0

    def submit_interval(self, failures: int) -> float:
        return min(self.min_submit_interval_s * 2 ** min(failures, 20), self.max_backoff_s)


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    unmanaged_pools: list[str]
    next_submit_at: dict[str, float] = field(default_factory=dict)


def retire_reason(job: ObservedJob, now: float, handover_lead_s: float) -> str:
    """Why a job must be replaced, or "" when it may stay."""
    if job.on_bad_node:
        return "node drained or down"
    if job.stale_spec:
        return "pool spec changed"
    if job.ends_at is not None and not job.pending and job.ends_at - now < handover_lead_s:
        return "time limit near"
    return ""


def _surplus_order(job: ObservedJob) -> tuple[bool, bool, int, int]:
    return (not job.pending, job.serving, -job.submit_time, -job.job_id)


def reconcile(
    desired: Mapping[str, int],
    jobs: Sequence[ObservedJob],
    memory: PoolMemory,
    *,
    now: float,
    timing: Timing,
    admin_serving: Mapping[str, int] | None = None,
) -> Plan:
    admin_serving = admin_serving or {}
    actions: list[Action] = []
    next_submit_at: dict[str, float] = {}
    by_pool: dict[str, list[ObservedJob]] = {}
    for job in jobs:
        by_pool.setdefault(job.pool, []).append(job)

    for job in jobs:
        started = memory.draining_since.get(job.job_id)
        if started is not None and now - started > timing.drain_deadline_s:
            actions.append(
                Cancel(job.job_id, job.pool, f"drain took over {timing.drain_deadline_s:g}s")
            )

    for pool, want in desired.items():
        active = [j for j in by_pool.get(pool, []) if j.job_id not in memory.draining_since]
        retiring = {
            j.job_id: r for j in active if (r := retire_reason(j, now, timing.handover_lead_s))
        }
        live = [j for j in active if j.job_id not in retiring]
        admin = admin_serving.get(pool, 0)
        capacity = len(live) + admin
        if capacity < want:
            last = memory.last_submit.get(pool)
            ready_at = (
                now if last is None
                else last + timing.submit_interval(memory.failures.get(pool, 0))
            )  # fmt: skip
            next_submit_at[pool] = ready_at
            if now >= ready_at:
                actions.append(Submit(pool, want - capacity))
        elif capacity > want and live:
            surplus = sorted(live, key=_surplus_order)[: min(capacity - want, len(live))]
            for job in surplus:
                if job.pending or not job.serving:
                    actions.append(Cancel(job.job_id, pool, "scale down"))
                else:
                    actions.append(Drain(job.job_id, pool))
        serving_without_retiring = sum(1 for j in live if j.serving) + admin
        for job in active:
            reason = retiring.get(job.job_id)
            if reason is None:
                continue
            if not job.serving:
                actions.append(Cancel(job.job_id, pool, reason))
            elif serving_without_retiring >= want:
                actions.append(Drain(job.job_id, pool, reason))

    unmanaged = sorted(set(by_pool) - set(desired))
    return Plan(actions=actions, unmanaged_pools=unmanaged, next_submit_at=next_submit_at)
