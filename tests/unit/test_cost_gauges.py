"""The pool manager's cost gauges (poolmgr/cost_gauges.py): GPUs of running jobs, and the
GPU-hour price of each pool's partition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from hpcserve.config import parse_config
from hpcserve.poolmgr.cost_gauges import CostGauges
from hpcserve.poolmgr.identity import new_identity
from hpcserve.slurm.parse import JobState, SlurmJob


def _job(job_id: int, state: JobState, nodes: list[str]) -> SlurmJob:
    return SlurmJob(job_id, "hpcserve-x", state, "None", nodes, "gpu", "", 0, None, None, None, "")


def test_gpus_of_running_jobs_and_the_partition_price() -> None:
    config = parse_config(
        {
            "slurm": {"partition": "gpu", "batch_partition": "scavenger"},
            "cost": {"gpu_hour_price": 2.5, "partition_gpu_hour_price": {"scavenger": 0.5}},
            "pools": [
                {"name": "chat", "served_model_name": "chat", "model_path": "/m",
                 "gpus_per_replica": 2, "engine": "sim"},
                {"name": "big", "served_model_name": "big", "model_path": "/m",
                 "gpus_per_replica": 4, "nodes_per_replica": 2, "tensor_parallel": 4, "pipeline_parallel": 2},
                {"name": "bulk", "served_model_name": "chat", "model_path": "/m", "role": "batch"},
            ],
        }
    )  # fmt: skip
    registry = CollectorRegistry()
    gauges = CostGauges(registry)
    ours = [
        (_job(1, JobState.RUNNING, ["n1"]), new_identity("chat", "chat")),
        (_job(2, JobState.RUNNING, ["n2"]), new_identity("chat", "chat")),
        (_job(3, JobState.PENDING, []), new_identity("chat", "chat")),
        (_job(4, JobState.RUNNING, ["n1", "n2"]), new_identity("big", "big")),
        (_job(5, JobState.RUNNING, ["n1"]), new_identity("gone", "old")),  # not configured
    ]
    gauges.update(config, ours)

    def value(name: str, pool: str, model: str) -> float | None:
        return registry.get_sample_value(name, {"pool": pool, "model": model})

    assert value("hpcserve_poolmgr_pool_gpus", "chat", "chat") == 4
    assert value("hpcserve_poolmgr_pool_gpus", "big", "big") == 8
    assert value("hpcserve_poolmgr_pool_gpus", "bulk", "chat") == 0
    assert value("hpcserve_poolmgr_pool_gpus", "gone", "old") is None
    assert value("hpcserve_poolmgr_gpu_hour_price", "chat", "chat") == 2.5
    assert value("hpcserve_poolmgr_gpu_hour_price", "bulk", "chat") == 0.5
    gauges.update(config, [])
    assert value("hpcserve_poolmgr_pool_gpus", "chat", "chat") == 0
    unpriced = CostGauges(CollectorRegistry())
    unpriced.update(
        parse_config(
            {"pools": [{"name": "chat", "served_model_name": "chat", "model_path": "/m"}]}
        ),
        [],
    )
    assert unpriced.price.collect()[0].samples == []
