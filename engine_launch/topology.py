"""Where this engine runs, read from the variables Slurm sets in a job (pure)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Topology:
    job_id: int
    node: str
    nodelist: str
    num_nodes: int
    node_rank: int
    # Set only in the tasks that `srun` starts (not in the batch shell): the step's node
    # count, this task's rank in the step, and whether SLURM_NODEID was there at all.
    step_num_nodes: int = 0
    task_rank: int = -1
    has_node_rank: bool = False

    @property
    def in_slurm(self) -> bool:
        return self.job_id > 0

    @property
    def in_step(self) -> bool:
        return self.step_num_nodes > 0


def topology_from_env(env: Mapping[str, str]) -> Topology:
    def as_int(key: str, default: int) -> int:
        value = env.get(key, "")
        try:
            return int(value)
        except ValueError:
            return default

    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return Topology(
        job_id=as_int("SLURM_JOB_ID", 0),
        node=node,
        nodelist=env.get("SLURM_JOB_NODELIST", node),
        num_nodes=as_int("SLURM_JOB_NUM_NODES", 1),
        node_rank=as_int("SLURM_NODEID", 0),
        step_num_nodes=as_int("SLURM_STEP_NUM_NODES", 0),
        task_rank=as_int("SLURM_PROCID", -1),
        has_node_rank=as_int("SLURM_NODEID", -1) >= 0,
    )


def replica_node_rank(topology: Topology, nnodes: int, explicit: int = -1) -> int:
    """This engine's node rank in a replica of `nnodes` nodes: `explicit` when given (>= 0),
    else SLURM_NODEID of the `srun` task, which must be the only task on its node and part
    of a step spanning exactly `nnodes` nodes. Rank 0 runs vLLM's API server; the others run
    headless workers. Raises TopologyError naming what is wrong."""
    if nnodes < 1:
        raise TopologyError(f"--nnodes {nnodes}: expected at least 1")
    if explicit >= 0:
        if explicit >= nnodes:
            raise TopologyError(f"--node-rank {explicit}: expected 0..{nnodes - 1}")
        return explicit
    if nnodes == 1:
        return 0
    if not topology.in_step or not topology.has_node_rank:
        raise TopologyError(
            f"--nnodes {nnodes} needs each node's rank: run one task per node with srun "
            "(which sets SLURM_NODEID and SLURM_STEP_NUM_NODES), or pass --node-rank"
        )
    if topology.step_num_nodes != nnodes:
        raise TopologyError(
            f"--nnodes {nnodes}, but this srun step spans {topology.step_num_nodes} node(s) "
            "(SLURM_STEP_NUM_NODES)"
        )
    if topology.task_rank != topology.node_rank:
        raise TopologyError(
            f"task {topology.task_rank} runs on node rank {topology.node_rank}: a multi-node "
            "replica needs exactly one task per node (srun --ntasks-per-node=1)"
        )
    return topology.node_rank
