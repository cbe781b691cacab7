"""Placement that prefers nodes whose cache already holds a pool's model (pure).

Engines report their node cache's entries (cache keys, `name@version-<digest>`) when they
register; the pool manager reads them from the router's replica list each poll and
remembers, per node, the last report (`CacheInventory`), also after that replica ended:
the entries stay on the node's disk until evicted. A stale entry costs at most one
placement on a node that then stages the model again.

Slurm 22.05 has no soft node preference: `--nodelist` is a requirement (a job with a busy
listed node waits for it), and `--prefer` takes node features, which an admin would have
to keep in step with every node's cache. So the pool manager asks for a holder only when
one can start the job now: up, not drained, in the partition, with the GPUs free (GRES
total minus used). Several jobs of one submission are spread over the holders' free GPUs;
the rest go unconstrained, and so does everything when no holder has room.

A pinned job can still be stranded, and a `--nodelist` job waits for its node forever:
the node goes down or is drained after submission, or it stays up but the job loses the
race for it (another job takes the free GPUs first: reason `Resources`; jobs ahead of it
will: `Priority`). `PinWatch` finds such jobs (pending, pinned, and a pinned node down,
drained or gone in the node listing, or a pending reason that waits for nodes) and reports
those stranded for `wait_s`; the pool manager then replaces them (reconcile retires them
like jobs on a bad node). The replacement is not pinned there: placement skips down and
drained nodes, and `PinWatch.avoided` holds the nodes of stranded jobs out of placement for
another `wait_s` (a node can look free and still not start the job: memory, a reservation,
a higher-priority job planned there). Reasons that would hold an unpinned job as well
(BeginTime, Dependency, holds, QOS limits) do not count: unpinning would not help.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from hpcserve.slurm.parse import (
    JobState,
    SlurmJob,
    SlurmNode,
    unavailable_required_nodes,
    waits_for_nodes,
)

_GPU_COUNT = re.compile(r"gpu(?::[^:,(]+)?:(\d+)")


def gpu_count(gres: str) -> int:
    """GPUs in a GRES string: "gpu:4", "gpu:a100:4", "gpu:1(IDX:0)", "gpu:a:2,gpu:b:2"."""
    return sum(int(n) for n in _GPU_COUNT.findall(gres))


@dataclass
class CacheInventory:
    """node -> the cache keys its engines last reported."""

    keys: dict[str, set[str]] = field(default_factory=dict)

    def report(self, node: str, keys: Iterable[str]) -> None:
        # An engine without a node cache reports nothing: that says nothing about the node.
        reported = set(keys)
        if node and reported:
            self.keys[node] = reported

    def holders(self, key: str) -> list[str]:
        return sorted(node for node, keys in self.keys.items() if key in keys)


def free_gpus(node: SlurmNode) -> int:
    return gpu_count(node.gres) - gpu_count(node.gres_used)


def placements(
    holders: Sequence[str],
    nodes: Sequence[SlurmNode],
    *,
    jobs: int,
    gpus_per_job: int,
    partition: str = "",
    avoid: Collection[str] = (),
) -> list[str]:
    """For each of `jobs` one-node jobs, a holder to pin it to ("" for none), the holder
    with room for the most such jobs first. A job needs `gpus_per_job` free GPUs and at
    least one free CPU. Nodes in `avoid` are never chosen."""
    room = {
        n.name: _room(n, gpus_per_job)
        for n in nodes
        if n.name in holders
        and n.name not in avoid
        and not (n.drained or n.down)
        and (not partition or partition in n.partitions)
    }
    out: list[str] = []
    for _ in range(jobs):
        fits = [name for name, free in room.items() if free > 0]
        if not fits:
            out.append("")
            continue
        best = min(fits, key=lambda name: (-room[name], name))
        room[best] -= 1
        out.append(best)
    return out


def _room(node: SlurmNode, gpus_per_job: int) -> int:
    """How many such jobs fit on the node now."""
    cpus = 1 if node.cpus is None or node.alloc_cpus is None else node.cpus - node.alloc_cpus
    if gpus_per_job <= 0:
        return max(cpus, 0)
    return max(min(free_gpus(node) // gpus_per_job, cpus), 0)


def free_room(
    nodes: Sequence[SlurmNode], *, gpus_per_job: int, nodes_per_job: int = 1, partition: str = ""
) -> int:
    """How many more jobs of this shape fit on the nodes' free GPUs and CPUs now (up, not
    drained, in the partition); a job across several nodes needs that many nodes with room."""
    fits = [
        _room(n, gpus_per_job)
        for n in nodes
        if not (n.drained or n.down) and (not partition or partition in n.partitions)
    ]
    if nodes_per_job > 1:
        return sum(1 for f in fits if f > 0) // nodes_per_job
    return sum(fits)


def job_pins(
    inventory: CacheInventory,
    cache_key: str,
    nodes: Sequence[SlurmNode],
    *,
    jobs: int,
    gpus_per_job: int,
    nodes_per_job: int = 1,
    partition: str = "",
    sbatch_args: Sequence[str] = (),
    avoid: Collection[str] = (),
) -> list[str]:
    """The node to pin each of `jobs` new replicas to ("" for none): a node that holds
    `cache_key` and can start it now. None for a model outside the registry (no key), a
    multi-node replica, or a pool whose own sbatch arguments already choose nodes."""
    if not cache_key or nodes_per_job > 1 or chooses_nodes(sbatch_args):
        return [""] * jobs
    return placements(
        inventory.holders(cache_key),
        nodes,
        jobs=jobs,
        gpus_per_job=gpus_per_job,
        partition=partition,
        avoid=avoid,
    )


def chooses_nodes(sbatch_args: Sequence[str]) -> bool:
    """Whether a pool's own sbatch arguments pick or exclude nodes (then it is never pinned)."""
    return any(a.startswith(("--nodelist", "-w", "--exclude", "-x")) for a in sbatch_args)


def unavailable_pin(job: SlurmJob, nodes: Sequence[SlurmNode]) -> list[str]:
    """The nodes a pending pinned job (`--nodelist`) waits for in vain: down, drained or
    missing in the node listing, or named unavailable by Slurm's pending reason. Empty
    when the job is not pending, not pinned, or its nodes can still take it."""
    if job.state is not JobState.PENDING or not job.required_nodes:
        return []
    by_name = {n.name: n for n in nodes}

    def gone(name: str) -> bool:
        node = by_name.get(name)
        if node is None:
            return bool(by_name)  # an empty listing (not read yet) says nothing
        return node.down or node.drained

    bad = [name for name in job.required_nodes if gone(name)]
    named = unavailable_required_nodes(job.state_reason, job.state_description) or []
    return bad + [n for n in named if n in job.required_nodes and n not in bad]


def pin_wait(job: SlurmJob, nodes: Sequence[SlurmNode]) -> list[str]:
    """The pinned nodes a pending pinned job waits for: the unavailable ones
    (`unavailable_pin`), else all of them when Slurm's pending reason says it waits for
    nodes (up but busy: it lost the race for them). Empty when it waits for nothing of
    its pin (not pending, not pinned, held, waiting for its begin time or a dependency)."""
    bad = unavailable_pin(job, nodes)
    if bad or job.state is not JobState.PENDING or not job.required_nodes:
        return bad
    if waits_for_nodes(job.state_reason, job.state_description):
        return list(job.required_nodes)
    return []


@dataclass
class PinWatch:
    """Pending pinned jobs that wait for their pinned nodes, and since when each was seen so;
    and the nodes that stranded such a job, held out of placement for a while."""

    wait_s: float
    since: dict[int, float] = field(default_factory=dict)
    avoid_until: dict[str, float] = field(default_factory=dict)

    def stranded(
        self, jobs: Iterable[SlurmJob], nodes: Sequence[SlurmNode], now: float
    ) -> dict[int, list[str]]:
        """job id -> the pinned nodes it waits for, for the jobs seen waiting (this call and
        every call since) for at least `wait_s`; a job that recovers starts over. Their
        nodes are avoided (`avoided`) for the next `wait_s`."""
        seen = {job.job_id: bad for job in jobs if (bad := pin_wait(job, nodes))}
        self.since = {job_id: self.since.get(job_id, now) for job_id in seen}
        out = {
            job_id: bad for job_id, bad in seen.items() if now - self.since[job_id] >= self.wait_s
        }
        for name in {name for bad in out.values() for name in bad}:
            self.avoid_until[name] = now + self.wait_s
        return out

    def avoided(self, now: float) -> set[str]:
        """Nodes not to pin new jobs to: they stranded a pinned job within `wait_s`."""
        self.avoid_until = {n: t for n, t in self.avoid_until.items() if t >= now}
        return set(self.avoid_until)
