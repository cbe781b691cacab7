"""The pool manager's control loop: observe Slurm once per poll, reconcile, act.

Observation is one `squeue` call for all of hpcserve's jobs, whatever their
number. Acting is submissions rendered from slurm_templates/ and cancellations,
each through the one SlurmClient. A failed status read is logged and retried on
the next poll; a failed submission is logged with Slurm's own words and retried
no sooner than `poolmgr.min_submit_interval_s`.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from hpcserve.config import PlatformConfig, PoolConfig
from hpcserve.poolmgr.identity import JobIdentity, new_identity, parse_comment
from hpcserve.poolmgr.reconcile import Cancel, Drain, ObservedJob, PoolMemory, Submit, reconcile
from hpcserve.poolmgr.render import JobSpec, render
from hpcserve.poolmgr.slurm import SlurmClient, SlurmError
from hpcserve.poolmgr.slurm_parse import JobState, SlurmJob

log = logging.getLogger(__name__)


class PoolMgrMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Gauge(
            "hpcserve_poolmgr_jobs",
            "hpcserve jobs in Slurm by pool and state",
            ["pool", "state"],
            registry=registry,
        )
        self.desired = Gauge(
            "hpcserve_poolmgr_desired_replicas",
            "Desired replicas by pool",
            ["pool"],
            registry=registry,
        )
        self.actions = Counter(
            "hpcserve_poolmgr_actions_total",
            "Actions taken by kind and pool",
            ["kind", "pool"],
            registry=registry,
        )
        self.errors = Counter(
            "hpcserve_poolmgr_slurm_errors_total",
            "Failed Slurm calls by operation",
            ["op"],
            registry=registry,
        )
        self.poll_seconds = Gauge(
            "hpcserve_poolmgr_last_poll_seconds",
            "Duration of the last reconcile pass",
            registry=registry,
        )


def hpcserve_executable() -> str:
    """The `hpcserve` console script next to this interpreter (the job runs the same install)."""
    beside = Path(sys.executable).with_name("hpcserve")
    if beside.exists():
        return str(beside)
    return shutil.which("hpcserve") or "hpcserve"


def job_log_dir(config: PlatformConfig) -> Path:
    return Path(config.slurm.log_dir or Path(config.state_dir) / "jobs")


def build_job_spec(config: PlatformConfig, pool: PoolConfig) -> JobSpec:
    """The values of one replica's job script; a fresh identity (nonce) each call."""
    identity = new_identity(pool.name, pool.model)
    return JobSpec(
        job_name=f"{config.poolmgr.job_name_prefix}-{pool.name}",
        comment=identity.comment(),
        gpus=pool.gpus_per_replica,
        time_limit_min=config.slurm.time_limit_min,
        drain_s=config.slurm.drain_s,
        hpcserve_bin=hpcserve_executable(),
        model_path=pool.model_path,
        model=pool.model,
        router=config.router.engines_dial(),
        pool=pool.name,
        engine=pool.engine,
        tensor_parallel=pool.tensor_parallel,
        pipeline_parallel=pool.pipeline_parallel,
        bind_host=config.engine.bind_host,
        advertise_host=config.engine.advertise_host,
        partition=config.slurm.partition,
        account=config.slurm.account,
        qos=config.slurm.qos,
        output=str(job_log_dir(config) / "%x-%j.out"),
        engine_args=tuple(pool.engine_args),
        env=tuple(sorted(pool.env.items())),
    )


class PoolManager:
    def __init__(
        self,
        config: PlatformConfig,
        slurm: SlurmClient,
        *,
        metrics_registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.slurm = slurm
        self.memory = PoolMemory()
        self.metrics = PoolMgrMetrics(metrics_registry or CollectorRegistry())
        self._clock = clock
        self._stop = threading.Event()
        self._seen_states: dict[int, JobState] = {}
        self.log_dir = job_log_dir(config)

    @property
    def prefix(self) -> str:
        return self.config.poolmgr.job_name_prefix

    def desired(self) -> dict[str, int]:
        return {pool.name: pool.replicas for pool in self.config.pools}

    def observe(self) -> list[ObservedJob]:
        snapshot = self.slurm.jobs(name_prefix=self.prefix + "-")
        ours = [
            (job, identity)
            for job in snapshot.jobs
            if (identity := parse_comment(job.comment)) is not None
        ]
        self._log_state_changes(ours)
        observed = [
            ObservedJob(
                job.job_id,
                identity.pool,
                pending=job.state is JobState.PENDING,
                submit_time=job.submit_time,
            )
            for job, identity in ours
            if job.state.is_active
        ]
        still_there = {j.job_id for j in observed}
        for job_id in list(self.memory.draining_since):
            if job_id not in still_there:
                del self.memory.draining_since[job_id]
        return observed

    def _log_state_changes(self, ours: list[tuple[SlurmJob, JobIdentity]]) -> None:
        counts: dict[tuple[str, str], int] = {}
        for job, identity in ours:
            before = self._seen_states.get(job.job_id)
            if before is not job.state:
                reason = f" ({job.state_reason})" if job.state_reason not in ("", "None") else ""
                nodes = f" on {','.join(job.nodes)}" if job.nodes else ""
                log.info(
                    "pool %s: job %d %s -> %s%s%s",
                    identity.pool,
                    job.job_id,
                    before.value if before else "new",
                    job.state.value,
                    nodes,
                    reason,
                )
            key = (identity.pool, job.state.value)
            counts[key] = counts.get(key, 0) + 1
        self._seen_states = {job.job_id: job.state for job, _ in ours}
        self.metrics.jobs.clear()
        for (pool, state), n in counts.items():
            self.metrics.jobs.labels(pool, state).set(n)

    def poll_once(self) -> None:
        started = time.perf_counter()
        try:
            observed = self.observe()
        except SlurmError as err:
            self.metrics.errors.labels("squeue").inc()
            log.warning("cannot read job states, retrying next poll: %s", err)
            return
        now = self._clock()
        for name, want in self.desired().items():
            self.metrics.desired.labels(name).set(want)
        plan = reconcile(
            self.desired(),
            observed,
            self.memory,
            now=now,
            min_submit_interval_s=self.config.poolmgr.min_submit_interval_s,
            drain_deadline_s=self.config.slurm.drain_s + 60,
        )
        for pool in plan.unmanaged_pools:
            log.debug("jobs of unconfigured pool %s left alone", pool)
        for action in plan.actions:
            self.metrics.actions.labels(type(action).__name__.lower(), action.pool).inc()
            match action:
                case Submit():
                    self._submit(self.config.pool(action.pool), action.count, now)
                case Drain():
                    self._drain(action, now)
                case Cancel():
                    self._cancel(action)
        self.metrics.poll_seconds.set(time.perf_counter() - started)

    def _submit(self, pool: PoolConfig, count: int, now: float) -> None:
        self.memory.last_submit[pool.name] = now
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(count):
            script = render(build_job_spec(self.config, pool))
            try:
                job_id = self.slurm.submit(
                    script, extra_args=[*self.config.slurm.extra_args, *pool.sbatch_args]
                )
            except SlurmError as err:
                self.metrics.errors.labels("sbatch").inc()
                log.error("pool %s: submission failed: %s", pool.name, err)
                return
            log.info("pool %s: submitted job %d", pool.name, job_id)

    def _drain(self, action: Drain, now: float) -> None:
        try:
            self.slurm.cancel([action.job_id], signal="USR1", batch_only=True)
        except SlurmError as err:
            self.metrics.errors.labels("scancel").inc()
            log.error("pool %s: cannot signal job %d to drain: %s", action.pool, action.job_id, err)
            return
        self.memory.draining_since[action.job_id] = now
        log.info("pool %s: draining job %d (scale down)", action.pool, action.job_id)

    def _cancel(self, action: Cancel) -> None:
        try:
            self.slurm.cancel([action.job_id])
        except SlurmError as err:
            self.metrics.errors.labels("scancel").inc()
            log.error("pool %s: cannot cancel job %d: %s", action.pool, action.job_id, err)
            return
        log.info("pool %s: cancelled job %d (%s)", action.pool, action.job_id, action.reason)

    def stop(self) -> None:
        self._stop.set()

    def run_forever(self) -> None:
        log.info(
            "pool manager started: %s",
            ", ".join(f"{p.name}={p.replicas}" for p in self.config.pools) or "no pools",
        )
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.config.poolmgr.poll_s)
        log.info("pool manager stopped")
