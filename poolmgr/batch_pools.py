"""Elastic batch pools in the pool manager: each poll, the size of every batch pool with
`max_replicas`, from the Batch API backlog and the cluster's idle GPUs.

The backlog is read from the batch store (contracts/batch_backlog.py): one SQLite database on
the control node shared by every gateway, so one read is the whole backlog however many
gateways run, and nothing has to report it. A batch line may name a LoRA adapter as its
model: its requests count against the batch pool whose registry version the adapter is
bound to (its base model, for an adapter bound to no version), when that pool has LoRA on.
The decision itself is batch_sizing.py's pure
function; this module gathers its inputs, remembers the last size and when the backlog was
last seen, logs a line when a pool's size changes and sets the metrics.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from hpcserve.config import PlatformConfig, PoolConfig
from hpcserve.contracts.batch_backlog import BacklogReadError, read_backlog
from hpcserve.modelcache.registry import Registry, RegistryError
from hpcserve.poolmgr.batch_sizing import BatchPoolView, batch_pool_size
from hpcserve.poolmgr.placement import free_room
from hpcserve.poolmgr.reconcile import ObservedJob
from hpcserve.poolmgr.spec import job_partition
from hpcserve.slurm.parse import SlurmNode

log = logging.getLogger(__name__)


def is_elastic(pool: PoolConfig) -> bool:
    return pool.role == "batch" and pool.max_replicas > 0


def adapter_backlog(
    registry_path: Path, pools: Sequence[PoolConfig], backlog: Mapping[str, int]
) -> dict[str, int]:
    """Pool -> backlog of the LoRA adapters its registry version serves (pools with LoRA on
    and a model_ref only; {} when the registry cannot be read, logged)."""
    lora = [pool for pool in pools if pool.max_loras and pool.model_ref]
    if not lora or not backlog or not registry_path.exists():
        return {}
    out: dict[str, int] = {}
    try:
        with Registry(registry_path) as registry:
            adapters = [a for a in registry.adapters() if backlog.get(a.name)]
            for pool in lora if adapters else []:
                version = registry.version(pool.model_ref)
                out[pool.name] = sum(
                    backlog[a.name]
                    for a in adapters
                    if (
                        a.base_ref == version.ref
                        if a.base_version
                        else a.base_model == version.model
                    )
                )
    except (RegistryError, OSError, sqlite3.Error) as err:
        log.warning(
            "cannot read LoRA adapters from %s, not counting their backlog: %s", registry_path, err
        )
        return {}
    return out


class BatchPoolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.backlog = Gauge(
            "hpcserve_poolmgr_batch_backlog_requests",
            "Batch API requests of an elastic batch pool's model not answered yet",
            ["pool"],
            registry=registry,
        )
        self.replicas = Gauge(
            "hpcserve_poolmgr_batch_replicas",
            "Elastic batch pool replicas: desired, running (started) and pending jobs",
            ["pool", "kind"],
            registry=registry,
        )


class BatchPools:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.metrics = BatchPoolMetrics(registry)
        self.sizes: dict[str, int] = {}  # pool -> the size decided at the last poll
        self.backlog: dict[str, int] = {}  # model -> requests, as last read
        self.pool_backlog: dict[str, int] = {}  # elastic pool -> requests, adapters included
        self.backlog_seen_at: dict[str, float] = {}  # pool -> when it last had a backlog

    def resize(
        self,
        config: PlatformConfig,
        desired: Mapping[str, int],
        jobs: Sequence[ObservedJob],
        draining: Mapping[int, float],
        nodes: Sequence[SlurmNode],
        now: float,
    ) -> dict[str, int]:
        """`desired` with each elastic batch pool's size in place of its floor."""
        elastic = [pool for pool in config.pools if is_elastic(pool)]
        if not elastic:
            return dict(desired)
        try:
            self.backlog = read_backlog(Path(config.batch_dir()))
        except BacklogReadError as err:
            log.warning("%s; using the last known backlog", err)
        served = {p.model for p in config.pools}
        unserved = {m: n for m, n in self.backlog.items() if m not in served}  # adapters?
        adapters = adapter_backlog(Path(config.registry_path()), elastic, unserved)
        interactive = {p.name for p in config.pools if p.role != "batch"}
        live = [j for j in jobs if j.job_id not in draining]
        waiting = [now - j.submit_time for j in live if j.pending and j.pool in interactive]
        out = dict(desired)
        for pool in elastic:
            floor = desired.get(pool.name, pool.replicas)
            mine = [j for j in live if j.pool == pool.name]
            pending = sum(1 for j in mine if j.pending)
            running = len(mine) - pending
            backlog = self.backlog.get(pool.model, 0) + adapters.get(pool.name, 0)
            self.pool_backlog[pool.name] = backlog
            if backlog > 0:
                self.backlog_seen_at[pool.name] = now
            seen = self.backlog_seen_at.get(pool.name)
            view = BatchPoolView(
                floor=floor,
                ceiling=max(pool.max_replicas, floor),
                backlog=backlog,
                per_replica=pool.backlog_per_replica,
                running=running,
                pending=pending,
                room=free_room(
                    nodes,
                    gpus_per_job=pool.gpus_per_replica,
                    nodes_per_job=pool.nodes_per_replica,
                    partition=job_partition(config, pool),
                ),
                interactive_pending=bool(waiting),
                interactive_waited_s=max(waiting, default=0.0),
                yield_after_s=config.poolmgr.batch_yield_after_s,
                draining=sum(1 for j in jobs if j.pool == pool.name and j.job_id in draining),
                current=self.sizes.get(pool.name, max(floor, running + pending)),
                idle_for_s=math.inf if seen is None else now - seen,
                scale_down_after_s=pool.scale_down_after_s,
            )
            size = batch_pool_size(view)
            before = self.sizes.get(pool.name)
            if size.replicas != before:
                log.info(
                    "pool %s: batch pool size %s -> %d (%s; %d running, %d pending)",
                    pool.name,
                    "start" if before is None else before,
                    size.replicas,
                    size.reason,
                    running,
                    pending,
                )
            self.sizes[pool.name] = size.replicas
            out[pool.name] = size.replicas
            self.metrics.backlog.labels(pool.name).set(backlog)
            for kind, n in (("desired", size.replicas), ("running", running), ("pending", pending)):
                self.metrics.replicas.labels(pool.name, kind).set(n)
        return out
