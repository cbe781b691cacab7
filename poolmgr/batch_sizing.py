"""How big an elastic batch pool should be now (pure: the pool manager passes what it saw).

A batch pool (`role = "batch"`, `max_replicas` > `replicas`) fills the GPUs interactive
pools leave idle while Batch API requests wait, and gives them back when none do:

- with a backlog, it wants a replica per `backlog_per_replica` waiting requests, between
  `replicas` (the floor) and `max_replicas`; it grows only into room free now (replicas of
  its shape that fit on idle GPUs of its partition), and not at all while one of its own
  jobs is pending (it would wait for the same GPUs) or an interactive pool's job is pending
  (interactive pools always get the GPUs first);
- when an interactive pool's job has waited `batch_yield_after_s` in Slurm's queue, it
  drains one replica above the floor, then waits until that one is gone before draining
  another (a site that lets Slurm preempt batch jobs sees Slurm act first);
- without a backlog for `scale_down_after_s`, it goes back to the floor (the surplus
  replicas drain: in-flight requests finish);
- it never counts jobs that are gone: a batch job that Slurm preempted for an interactive
  one is no longer running, so the pool shrinks by it instead of resubmitting into a full
  cluster (the floor excepted, which waits pending as any pool's replica does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPoolView:
    floor: int
    ceiling: int
    backlog: int  # Batch API requests of the pool's model not answered yet
    per_replica: int  # backlog_per_replica
    running: int  # started jobs, not draining
    pending: int  # jobs waiting in Slurm's queue, not draining
    room: int  # more replicas of this pool's shape that fit on idle GPUs now
    interactive_pending: bool  # an interactive pool's job waits in Slurm's queue
    interactive_waited_s: float  # ... for this long (the longest waiting one); 0: none waits
    yield_after_s: float  # poolmgr.batch_yield_after_s
    draining: int  # its replicas draining now
    current: int  # the size decided at the last poll
    idle_for_s: float  # how long the backlog has been empty (0 while there is one)
    scale_down_after_s: float


@dataclass(frozen=True)
class BatchSize:
    replicas: int
    reason: str


def batch_pool_size(view: BatchPoolView) -> BatchSize:
    size = _by_backlog(view)
    v = view
    if not v.interactive_pending or v.interactive_waited_s < v.yield_after_s:
        return size
    if v.draining or v.running <= v.floor:
        yielded = BatchSize(min(v.current, v.running), "yielding to an interactive job")
    else:
        yielded = BatchSize(
            v.running - 1,
            f"an interactive job has waited {v.interactive_waited_s:.0f}s: yielding a replica",
        )
    if yielded.replicas >= size.replicas:
        return size
    return BatchSize(max(v.floor, yielded.replicas), yielded.reason)


def _by_backlog(v: BatchPoolView) -> BatchSize:
    if v.backlog <= 0:
        if v.idle_for_s >= v.scale_down_after_s:
            return BatchSize(v.floor, "no batch backlog")
        held = max(v.floor, min(v.current, v.running + v.pending))
        return BatchSize(held, f"no batch backlog for {v.idle_for_s:.0f}s; holding")
    want = min(max(-(-v.backlog // v.per_replica), v.floor), v.ceiling)
    if v.pending:
        fits, why = v.running + v.pending, "a replica of the pool is pending"
    elif v.interactive_pending:
        fits, why = v.running, "an interactive pool's job is pending"
    else:
        fits, why = v.running + v.room, f"room for {v.room} more"
    size = max(v.floor, min(want, fits))
    reason = f"batch backlog {v.backlog} requests wants {want}"
    if size < want:
        reason += f", {why}"
    return BatchSize(size, reason)
