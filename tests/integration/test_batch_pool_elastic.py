"""An elastic batch pool on the real two-node Slurm cluster, with simulated engines.

The cluster has a second partition over the same nodes for batch pools, in a lower
PriorityTier with PreemptType=preempt/partition_prio and PreemptMode=CANCEL (what a site
configures to let interactive jobs take a batch job's GPUs). The backlog is real Batch API
batches in the batch store the pool manager reads. Waits are polls until the state is seen.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hpcserve.config import PlatformConfig, parse_config
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.batch.store import BatchRecord, BatchStore, new_id
from hpcserve.gateway.batch.validate import validate_batch_file
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.state_files import read_status, write_override
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob
from tests.integration.slurm_helpers import (
    cluster_config,
    running_cluster,
    wait_for,
)

pytestmark = pytest.mark.slurm

SIM = {"model_path": "/nonexistent", "engine": "sim", "gpus_per_replica": 4}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """The test cluster, plus the preemptible batch partition."""
    yield from running_cluster(tmp_path_factory.mktemp("localslurm"), batch_partition="gpu-batch")


def jobs_of(slurm: SlurmCLI, name: str) -> list[SlurmJob]:
    """The pool manager's jobs named `name` (`<job_name_prefix>-<pool>`)."""
    return [j for j in slurm.jobs(name_prefix=name).jobs if j.name == name]


def serving_jobs(router: RouterServer) -> set[int]:
    return {r.slurm_job_id for r in list_replicas(router.config.routing_bind)}


def running(slurm: SlurmCLI, name: str) -> list[SlurmJob]:
    return [j for j in jobs_of(slurm, name) if j.state is JobState.RUNNING]


def add_backlog(store: BatchStore, model: str, lines: int) -> str:
    data = b"".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": "p"}}).encode() + b"\n"
        for i in range(lines)
    )  # fmt: skip
    temp = store.temp_path()
    temp.write_bytes(data)
    summary = validate_batch_file([data], max_lines=1000)
    file = store.add_file(temp, tenant="t", filename="in", purpose="batch", summary=summary)
    batch_id = new_id("batch_")
    store.create_batch(
        BatchRecord(
            id=batch_id, tenant="t", endpoint="/v1/completions", input_file_id=file.id,
            completion_window="24h", status="in_progress", created_at=1, expires_at=2,
            total=lines, model=model,
        )
    )  # fmt: skip
    return batch_id


def elastic_config(
    cluster: LocalSlurm, router: RouterServer, tmp_path: Path, prefix: str, **poolmgr: Any
) -> PlatformConfig:
    """Interactive pool p (1 replica of 4 GPUs: a whole node) and elastic batch pool b of the
    same model (0..1 replicas of 4 GPUs)."""
    base = msgspec.to_builtins(cluster_config(cluster, router, tmp_path, prefix, SIM))
    base["slurm"]["batch_partition"] = poolmgr.pop("batch_partition", "")
    base["poolmgr"] |= poolmgr
    base["pools"].append({"name": "b", "served_model_name": "p", "role": "batch", "replicas": 0,
                          "max_replicas": 1, "backlog_per_replica": 2, "scale_down_after_s": 0,
                          **SIM})  # fmt: skip
    return parse_config(base)


def polling(manager: PoolManager) -> Callable[..., Any]:
    def poll_until(what: str, condition: Callable[[], Any], timeout: float = 30) -> Any:
        def step() -> Any:
            manager.poll_once()
            return condition()

        return wait_for(what, step, timeout=timeout)

    return poll_until


def test_batch_pool_fills_the_idle_node_shrinks_back_and_yields_to_interactive(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> None:
    config = elastic_config(cluster, router, tmp_path, "el", batch_partition="gpu-batch")
    manager = PoolManager(config, slurm)
    poll_until = polling(manager)

    def batch_replicas() -> list[Any]:
        return [r for r in list_replicas(router.config.routing_bind) if r.pool == "b"]

    (interactive,) = poll_until("the interactive replica", lambda: running(slurm, "el-p"))
    assert jobs_of(slurm, "el-b") == []  # no backlog: the batch pool stays at its floor, 0

    store = BatchStore(Path(config.batch_dir()))
    batch_id = add_backlog(store, "p", 5)
    (replica,) = poll_until("a batch replica", batch_replicas)
    (grown,) = running(slurm, "el-b")
    assert grown.partition == "gpu-batch" and grown.nodes != interactive.nodes
    assert replica.role == "batch" and replica.slurm_job_id == grown.job_id

    # The backlog is answered: the replica drains and its job ends; the pool is back at 0.
    store.update_batch(batch_id, completed=5, status="completed")
    poll_until("the batch job to end", lambda: not any(
        j.state.is_active for j in jobs_of(slurm, "el-b")))  # fmt: skip
    assert {j.state for j in jobs_of(slurm, "el-b")} == {JobState.COMPLETED}

    # Backlog again: it grows again; then the interactive pool needs that node and takes it.
    add_backlog(store, "p", 5)
    (grown,) = poll_until("the batch pool to grow again", lambda: running(slurm, "el-b"))
    write_override(tmp_path, "p", 2)
    poll_until("two interactive jobs running", lambda: len(running(slurm, "el-p")) == 2)
    (preempted,) = [j for j in jobs_of(slurm, "el-b") if j.job_id == grown.job_id]
    assert preempted.state is JobState.PREEMPTED
    # Not a failure, and no resubmission into the full cluster while the backlog is there.
    for _ in range(3):
        manager.poll_once()
    assert [j.job_id for j in jobs_of(slurm, "el-b") if j.state.is_active] == []
    status = read_status(tmp_path)
    assert status is not None
    (b,) = [p for p in status.pools if p.pool == "b"]
    assert (b.failures, b.desired, b.role, b.max_replicas, b.backlog) == (0, 0, "batch", 1, 5)
    store.close()


def test_without_preemption_the_batch_pool_drains_a_replica_for_a_waiting_interactive_job(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> None:
    # Batch jobs in the interactive partition: Slurm does not preempt them.
    config = elastic_config(cluster, router, tmp_path, "ey", batch_yield_after_s=0)
    manager = PoolManager(config, slurm)
    poll_until = polling(manager)
    poll_until("the interactive replica", lambda: running(slurm, "ey-p"))
    store = BatchStore(Path(config.batch_dir()))
    add_backlog(store, "p", 5)
    (grown,) = poll_until("a batch replica", lambda: running(slurm, "ey-b"))
    assert grown.partition == "gpu"
    poll_until("it serves", lambda: grown.job_id in serving_jobs(router))
    write_override(tmp_path, "p", 2)
    poll_until("two interactive jobs running", lambda: len(running(slurm, "ey-p")) == 2)
    (drained,) = jobs_of(slurm, "ey-b")
    assert drained.state is JobState.COMPLETED  # drained (USR1), not preempted or cancelled
    store.close()
