"""Replicas across two nodes of a real Slurm cluster (engine-multinode.sbatch).

The pool manager renders and submits the multi-node template; `srun` starts one
`hpcserve engine` per node; node rank 0 serves and registers, rank 1 runs headless
workers; a drain (`scancel --signal=USR1 --batch`, what the pool manager and Slurm's
`--signal=B:USR1@drain_s` do) finishes the request in flight and ends the job COMPLETED
with no process left. The simulated engine proves the wiring in seconds; the last test
does it with real vLLM (CPU build), tensor parallel across the two nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcserve.config import PlatformConfig
from hpcserve.contracts.engine_token import auth_headers, read_token
from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.contracts.router_client import list_replicas
from hpcserve.engine_launch.load import parse_vllm_load
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import PROCESSES_GONE_S, cluster_config, wait_for
from tests.processes import job_cgroup_processes, session_processes

pytestmark = pytest.mark.slurm


def make_config(
    cluster: LocalSlurm, router: RouterServer, tmp_path: Path, prefix: str, pool: dict[str, Any]
) -> PlatformConfig:
    return cluster_config(
        cluster,
        router,
        tmp_path,
        prefix,
        {"nodes_per_replica": 2, **pool},
        slurm={"time_limit_min": 30, "drain_s": 20},
    )


def headless_sim(process: str) -> bool:
    """The simulated headless vLLM itself (not its keeper, whose command line holds it)."""
    return "sim.launch --headless" in process and "process_tree" not in process


def job_leftovers(job_id: int) -> list[str]:
    """What of a job still runs: by its SLURM_JOB_ID, and by its cgroup (proctrack/cgroup),
    which vLLM's renamed processes with a blanked environment cannot leave."""
    return job_processes(job_id) + job_cgroup_processes(job_id)


def job_processes(job_id: int) -> list[str]:
    """Live processes of a job: everything with its SLURM_JOB_ID in the environment."""
    found = []
    entry = f"SLURM_JOB_ID={job_id}".encode()
    for pid in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            if entry not in (pid / "environ").read_bytes().split(b"\0"):
                continue
            argv = (pid / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found.append(f"{pid.name}: " + " ".join(a.decode(errors="replace") for a in argv if a))
    return found


def completion(url: str, max_tokens: int, token: str, timeout: float = 60) -> dict[str, Any]:
    """Straight to the engine, with the deployment's engine token (engines refuse others)."""
    body = {
        "model": "p",
        "prompt": "The cluster",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # vLLM: every request runs to max_tokens (finish_reason "length")
    }
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **auth_headers(token)},
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return dict(json.load(resp))


class MultiNodeReplica:
    def __init__(self, manager: PoolManager, slurm: SlurmCLI, router: RouterServer) -> None:
        self.manager, self.slurm, self.router = manager, slurm, router

    def replicas(self) -> list[ReplicaInfo]:
        return list_replicas(self.router.config.routing_bind)

    def job(self) -> SlurmJob:
        prefix = self.manager.config.poolmgr.job_name_prefix + "-"
        (job,) = self.slurm.jobs(name_prefix=prefix).jobs
        return job

    def start(self, timeout: float) -> tuple[SlurmJob, ReplicaInfo]:
        def serving() -> bool:
            self.manager.poll_once()
            return bool(self.replicas())

        wait_for("the two-node replica to register", serving, timeout=timeout)
        (replica,) = self.replicas()
        return self.job(), replica

    def log(self, job: SlurmJob) -> str:
        logs = Path(self.manager.config.slurm.log_dir)
        return (logs / f"{job.name}-{job.job_id}.out").read_text()

    def start_request(self, url: str, max_tokens: int) -> tuple[threading.Thread, list[Any]]:
        """A request in flight: returns once the engine reports it running."""
        result: list[dict[str, Any]] = []
        token = read_token(self.manager.config.engine_token_path())
        thread = threading.Thread(
            target=lambda: result.append(completion(url, max_tokens, token, 120))
        )
        thread.start()

        def running() -> bool:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                return parse_vllm_load(resp.read().decode()).running >= 1

        wait_for("the request to run", running)
        return thread, result

    def drain_and_wait(
        self, job: SlurmJob, in_flight: threading.Thread, timeout: float
    ) -> SlurmJob:
        """What the pool manager does to drain a replica; the request must still be running
        when the replica has left routing."""
        self.slurm.cancel([job.job_id], signal="USR1", batch_only=True)
        wait_for("the replica to leave routing", lambda: not self.replicas())
        assert in_flight.is_alive(), "the drain should overlap the request in flight"
        wait_for("the job to end", lambda: not self.job().state.is_active, timeout=timeout)
        return self.job()


@pytest.fixture
def replica_for(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> Iterator[Any]:
    def make(prefix: str, pool: dict[str, Any]) -> MultiNodeReplica:
        config = make_config(cluster, router, tmp_path, prefix, pool)
        return MultiNodeReplica(PoolManager(config, slurm), slurm, router)

    yield make


def test_sim_replica_across_two_nodes_serves_registers_once_and_drains(replica_for: Any) -> None:
    pool = {
        "engine": "sim",
        "model_path": "/nonexistent",
        "tensor_parallel": 2,
        "engine_args": ["--decode-ms-per-token", "10"],
    }
    replica = replica_for("mn1", pool)
    job, info = replica.start(timeout=120)
    assert job.nodes == ["n1", "n2"] and job.state is JobState.RUNNING
    # One replica, registered by rank 0 on the head node.
    assert (info.slurm_job_id, info.node, info.pool) == (job.job_id, "n1", "p")
    procs = job_processes(job.job_id)
    engines = [p for p in procs if "hpcserve engine " in p and "srun " not in p]
    assert len(engines) == 2 and all("--nnodes 2" in p for p in engines), procs
    assert len([p for p in procs if headless_sim(p)]) == 1, procs

    # 6 s of decoding: time for the drain to take the replica out of routing on a loaded
    # machine before the request ends
    in_flight, result = replica.start_request(info.url, 600)
    ended = replica.drain_and_wait(job, in_flight, timeout=120)
    in_flight.join(120)
    assert result and result[0]["choices"][0]["finish_reason"] == "length"
    assert result[0]["usage"]["completion_tokens"] == 600, "the request in flight finished"
    assert ended.state is JobState.COMPLETED
    wait_for(
        "no process of the job", lambda: not job_leftovers(job.job_id), timeout=PROCESSES_GONE_S
    )

    log = replica.log(job)
    assert "0: " in log and "1: " in log  # srun --label: one engine per node rank
    head_stopped = log.index("engine stopped")
    assert "drain requested" in log
    assert log.index("the head engine closed the link") > head_stopped, (
        "rank 1 stopped its workers only after rank 0's engine was done"
    )


def test_a_lost_rank_fails_the_replica(replica_for: Any) -> None:
    replica = replica_for(
        "mn2", {"engine": "sim", "model_path": "/nonexistent", "pipeline_parallel": 2}
    )
    job, _ = replica.start(timeout=120)
    # Rank 1's "vLLM" dies: its engine fails; rank 0 sees it go and deregisters.
    (headless,) = [p for p in job_processes(job.job_id) if headless_sim(p)]
    os.kill(int(headless.split(":")[0]), signal.SIGKILL)
    wait_for("the replica to leave routing", lambda: not replica.replicas())
    wait_for("the job to end", lambda: not replica.job().state.is_active)
    assert replica.job().state is JobState.FAILED
    wait_for(
        "no process of the job", lambda: not job_leftovers(job.job_id), timeout=PROCESSES_GONE_S
    )
    log = replica.log(job)
    assert "headless vLLM exited with code -9" in log


@pytest.mark.vllm
def test_vllm_tensor_parallel_across_two_nodes_serves_and_drains(
    replica_for: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = make_tiny_model("chat", tmp_path_factory.mktemp("mn-model") / "tiny-chat")
    pool = {
        "engine": "vllm-cpu",
        "model_path": str(model),
        "tensor_parallel": 2,
        "engine_args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    }
    replica = replica_for("mn3", pool)
    started = time.monotonic()
    job, info = replica.start(timeout=420)
    print(f"two-node vLLM replica serving after {time.monotonic() - started:.0f}s")
    assert job.nodes == ["n1", "n2"]
    assert info.node == "n1"
    reply = completion(info.url, 8, read_token(replica.manager.config.engine_token_path()))
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["system_fingerprint"].startswith("vllm-") and "tp2" in reply["system_fingerprint"]

    in_flight, result = replica.start_request(info.url, 480)  # several seconds on 2 cores
    ended = replica.drain_and_wait(job, in_flight, timeout=120)
    in_flight.join(30)
    assert result and result[0]["choices"][0]["finish_reason"] == "length"
    assert result[0]["usage"]["completion_tokens"] == 480, "the request in flight finished"
    assert ended.state is JobState.COMPLETED
    wait_for(
        "no process of the job", lambda: not job_leftovers(job.job_id), timeout=PROCESSES_GONE_S
    )
    log = replica.log(job)
    # Each node's engine owned its vLLM's tree: nothing of either session is left.
    sessions = re.findall(r"starting (?:headless )?vLLM in session (\d+)", log)
    assert len(sessions) == 2 and all(session_processes(int(s)) == [] for s in sessions)
    assert "headless multiproc executor" in log  # rank 1 ran vLLM's headless workers
    assert log.index("the head engine closed the link") > log.index("engine stopped")
