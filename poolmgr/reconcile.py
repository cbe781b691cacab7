"""One reconcile step: desired replicas per pool vs the jobs Slurm reports -> actions (pure).

The pool manager calls `reconcile` once per poll with what it observed and acts
on the result; nothing here talks to Slurm or reads a clock, so every rule is a
table test.

Rules of the walking skeleton (issue 3 adds failure backoff, walltime handover,
admin-submitted capacity and node state):
- a pool with fewer live jobs than desired gets submissions, at most one burst
  per `min_submit_interval_s`, so a crash loop cannot flood slurmctld;
- a pool with more gets its surplus removed: pending jobs are cancelled outright,
  running ones are asked to drain (USR1 to the batch shell) and end by themselves;
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


@dataclass(frozen=True)
class Submit:
    pool: str
    count: int


@dataclass(frozen=True)
class Drain:
    job_id: int
    pool: str


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


@dataclass(frozen=True)
class Plan:
    actions: list[Action]
    unmanaged_pools: list[str]


def reconcile(
    desired: Mapping[str, int],
    jobs: Sequence[ObservedJob],
    memory: PoolMemory,
    *,
    now: float,
    min_submit_interval_s: float,
    drain_deadline_s: float,
) -> Plan:
    actions: list[Action] = []
    by_pool: dict[str, list[ObservedJob]] = {}
    for job in jobs:
        by_pool.setdefault(job.pool, []).append(job)

    for job in jobs:
        started = memory.draining_since.get(job.job_id)
        if started is not None and now - started > drain_deadline_s:
            actions.append(Cancel(job.job_id, job.pool, f"drain took over {drain_deadline_s:g}s"))

    for pool, want in desired.items():
        live = [j for j in by_pool.get(pool, []) if j.job_id not in memory.draining_since]
        if len(live) < want:
            last = memory.last_submit.get(pool)
            if last is None or now - last >= min_submit_interval_s:
                actions.append(Submit(pool, want - len(live)))
        elif len(live) > want:
            # Pending jobs go first (they serve nobody yet), then the newest running ones.
            surplus = sorted(live, key=lambda j: (not j.pending, -j.submit_time, -j.job_id))
            for job in surplus[: len(live) - want]:
                if job.pending:
                    actions.append(Cancel(job.job_id, pool, "scale down"))
                else:
                    actions.append(Drain(job.job_id, pool))

    unmanaged = sorted(set(by_pool) - set(desired))
    return Plan(actions=actions, unmanaged_pools=unmanaged)
