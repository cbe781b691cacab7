"""What the pool manager exports for the cost dashboard: the GPUs each pool's running jobs
hold, and the price of a GPU-hour where they run (`cost.gpu_hour_price`, per partition).
Prometheus' recording rules (deploy/prometheus/hpcserve-rules.yml, "cost") turn them and the
gateway's token counters into cost per hour and per million tokens, and idle GPUs; the
durable figures of a past period are `hpcserve report`'s (GPU-hours from Slurm's accounting).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge

from hpcserve.config import PlatformConfig
from hpcserve.poolmgr.identity import JobIdentity
from hpcserve.poolmgr.spec import job_partition
from hpcserve.slurm.parse import JobState, SlurmJob


class CostGauges:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.gpus = Gauge(
            "hpcserve_poolmgr_pool_gpus",
            "GPUs held by the pool's running Slurm jobs (what the GPU-hour price accrues on)",
            ["pool", "model"],
            registry=registry,
        )
        self.price = Gauge(
            "hpcserve_poolmgr_gpu_hour_price",
            "Price of a GPU-hour in the pool's partition (cost.gpu_hour_price or "
            "cost.partition_gpu_hour_price, in cost.currency); absent when not set",
            ["pool", "model"],
            registry=registry,
        )

    def update(self, config: PlatformConfig, ours: Sequence[tuple[SlurmJob, JobIdentity]]) -> None:
        pools = {pool.name: pool for pool in config.pools}
        gpus: dict[tuple[str, str], int] = {(p.name, p.model): 0 for p in config.pools}
        for job, identity in ours:
            pool = pools.get(identity.pool)
            if pool is None or job.state is not JobState.RUNNING:
                continue
            nodes = len(job.nodes) or pool.nodes_per_replica
            gpus[(pool.name, pool.model)] += pool.gpus_per_replica * nodes
        self.gpus.clear()
        for (pool_name, model), count in gpus.items():
            self.gpus.labels(pool_name, model).set(count)
        self.price.clear()
        cost = config.cost
        for pool in config.pools:
            price = cost.partition_gpu_hour_price.get(
                job_partition(config, pool), cost.gpu_hour_price
            )
            if price:
                self.price.labels(pool.name, pool.model).set(price)
