"""Where this engine runs, read from the variables Slurm sets in a job (pure)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    job_id: int
    node: str
    nodelist: str
    num_nodes: int
    node_rank: int

    @property
    def in_slurm(self) -> bool:
        return self.job_id > 0


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
    )
