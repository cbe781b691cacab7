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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hpcserve.poolmgr.slurm_parse import SlurmNode

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
) -> list[str]:
    """For each of `jobs` one-node jobs, a holder to pin it to ("" for none), the holder
    with room for the most such jobs first. A job needs `gpus_per_job` free GPUs and at
    least one free CPU."""
    room = {
        n.name: _room(n, gpus_per_job)
        for n in nodes
        if n.name in holders
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
) -> list[str]:
    """The node to pin each of `jobs` new replicas to ("" for none): a node that holds
    `cache_key` and can start it now. None for a model outside the registry (no key), a
    multi-node replica, or a pool whose own sbatch arguments already choose nodes."""
    chooses_nodes = any(a.startswith(("--nodelist", "-w", "--exclude", "-x")) for a in sbatch_args)
    if not cache_key or nodes_per_job > 1 or chooses_nodes:
        return [""] * jobs
    return placements(
        inventory.holders(cache_key),
        nodes,
        jobs=jobs,
        gpus_per_job=gpus_per_job,
        partition=partition,
    )
