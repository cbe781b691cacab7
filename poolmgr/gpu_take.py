"""Which pool gives a replica up when an autoscaled pool cannot get GPUs (pure).

When the partition is full, an autoscaled interactive pool that must grow waits in Slurm's
queue. Once one of its jobs has been pending for GPUs (Slurm's reason Resources or
Priority) for `poolmgr.take_gpus_after_s`, the pool manager takes a replica for it:

- from pools that could give GPUs it can use: the same partition, and a replica with at
  least as many GPUs per node on at least as many nodes;
- batch pools first: an elastic batch pool above its floor yields by itself
  (poolmgr/batch_sizing.py, after `batch_yield_after_s`), so while one can, nothing else is
  taken;
- then autoscaled interactive pools of lower `priority` (pools[].priority; equal
  priorities never take from each other, so two pools cannot trade a replica back and
  forth), lowest priority first, then the one furthest above its floor; only from one
  above its floor (autoscale.min, or a scheduled floor that applies now), with no job
  pending of its own (cancelling that would free nothing) and no `hpcserve scale` override
  (an admin's size wins); fixed-size pools and admins' jobs are never taken;
- one replica at a time: while a candidate still drains a replica (its GPUs are coming
  free), nothing more is taken.

The replica taken drains (it leaves routing, finishes what it has in flight and ends), so no
request fails. A pool that gave a replica does not grow back while a pool of higher
priority still waits for GPUs (autoscale.py holds it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# squeue's reasons for a job that waits for GPUs (not a limit, a dependency or a bad request).
WAITING_FOR_GPUS = frozenset({"Resources", "Priority"})


@dataclass(frozen=True)
class Shape:
    partition: str
    gpus_per_node: int
    nodes: int

    def covers(self, other: Shape) -> bool:
        """A replica of this shape frees the GPUs one of `other` needs."""
        return (
            self.partition == other.partition
            and self.gpus_per_node >= other.gpus_per_node
            and self.nodes >= other.nodes
        )


@dataclass(frozen=True)
class Waiting:
    """An autoscaled pool with a job pending for GPUs."""

    pool: str
    priority: int
    shape: Shape
    waited_s: float  # its longest-pending job's time in the queue
    job_id: int
    reason: str  # Slurm's pending reason


@dataclass(frozen=True)
class Donor:
    """A pool that might give a replica."""

    pool: str
    priority: int
    shape: Shape
    running: int  # its started jobs, not draining
    floor: int  # what it keeps: autoscale.min or the scheduled floor now
    pending: int = 0  # its own jobs waiting in Slurm's queue
    draining: int = 0  # its replicas draining now
    batch: bool = False  # an elastic batch pool: it yields by itself
    overridden: bool = False  # an admin's `hpcserve scale` holds its size


@dataclass(frozen=True)
class Take:
    donor: str
    waiting: str
    target: int  # the donor's new size
    reason: str


@dataclass(frozen=True)
class TakeDecision:
    take: Take | None
    reason: str  # why nothing is taken (for the log on change); "" when nothing waits


def choose(waiting: Sequence[Waiting], donors: Sequence[Donor], after_s: float) -> TakeDecision:
    due = [w for w in waiting if w.reason in WAITING_FOR_GPUS and w.waited_s >= after_s]
    if not due:
        return TakeDecision(None, "")
    # The highest priority first, then the one that has waited longest.
    for need in sorted(due, key=lambda w: (-w.priority, -w.waited_s)):
        fits = [d for d in donors if d.pool != need.pool and d.shape.covers(need.shape)]
        if any(d.draining for d in fits if d.batch or d.priority < need.priority):
            return TakeDecision(None, f"pool {need.pool}: a replica is draining for it")
        if any(d.batch and d.running > d.floor for d in fits):
            return TakeDecision(None, f"pool {need.pool}: a batch pool yields first")
        candidates = [
            d
            for d in fits
            if not d.batch
            and d.priority < need.priority
            and not d.overridden
            and not d.pending
            and d.running > d.floor
        ]
        if not candidates:
            continue
        donor = min(candidates, key=lambda d: (d.priority, -(d.running - d.floor), d.pool))
        why = (
            f"taken for pool {need.pool} (priority {need.priority} > {donor.priority}): its "
            f"job {need.job_id} has waited {need.waited_s:.0f} s for GPUs ({need.reason})"
        )
        return TakeDecision(Take(donor.pool, need.pool, donor.running - 1, why), "")
    names = ", ".join(sorted(w.pool for w in due))
    why = f"pool(s) {names} wait for GPUs; no pool of lower priority above its floor"
    return TakeDecision(None, why)
