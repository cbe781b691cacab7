"""The pool manager's control loop: observe, reconcile, act, report.

Each poll observes with exactly one `squeue` for all of hpcserve's jobs whatever their
number, one node listing (DRAIN/DOWN nodes) and one `ListReplicas` to the router (which jobs
serve, and admins' own replicas). Acting is submissions rendered from slurm_templates/ and
drains/cancellations, each through the one SlurmClient. A failed read is logged and the
last good observation used (the router) or the poll skipped (Slurm); a failed submission is
logged with Slurm's own words and retried after the backoff. SIGHUP (`hpcserve reload`)
re-reads the config at the next poll: pools whose replica spec changed are replaced one by
one, the others keep running. `hpcserve scale` writes overrides the next poll picks up.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from hpcserve.config import ConfigError, PlatformConfig, PoolConfig, load_config
from hpcserve.contracts.engine_token import EngineTokenError, ensure_token
from hpcserve.contracts.private_files import private_dir
from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.contracts.router_client import (
    RouterQueryError,
    list_health_events,
    replica_list,
)
from hpcserve.health.node_actions import NodeHealthActions
from hpcserve.modelcache.registry import RegistryError
from hpcserve.poolmgr.autoscale_capacity import check as check_capacities
from hpcserve.poolmgr.autoscale_pools import AutoscaledPools
from hpcserve.poolmgr.batch_pools import BatchPools, is_elastic
from hpcserve.poolmgr.canary_records import CanaryRecords
from hpcserve.poolmgr.cold_start import ColdStarts
from hpcserve.poolmgr.cost_gauges import CostGauges
from hpcserve.poolmgr.failures import FailureTracker
from hpcserve.poolmgr.job_records import JobRecords
from hpcserve.poolmgr.job_states import JobStates, Transition
from hpcserve.poolmgr.observe import Observation, observe
from hpcserve.poolmgr.placement import CacheInventory, PinWatch, chooses_nodes, job_pins
from hpcserve.poolmgr.reconcile import (
    Cancel,
    Drain,
    Plan,
    PoolMemory,
    Submit,
    Timing,
    reconcile,
    retire_reason,
)
from hpcserve.poolmgr.registry_usage import RegistryUsage
from hpcserve.poolmgr.rehearsal_clock import RehearsalClock
from hpcserve.poolmgr.render import render
from hpcserve.poolmgr.rollout_controller import RolloutController
from hpcserve.poolmgr.scrape_targets import ScrapeTargetsFile
from hpcserve.poolmgr.spec import (
    build_job_spec,
    job_log_dir,
    job_partition,
    pool_spec_digest,
    resolve_model,
)
from hpcserve.poolmgr.state_files import (
    AutoscaleStatus,
    PoolMgrStatus,
    PoolStatus,
    read_overrides,
    write_status,
)
from hpcserve.poolmgr.switches import SwitchTopology
from hpcserve.poolmgr.wake_names import PoolVersions, demand_by_model
from hpcserve.slurm.client import SlurmClient, SlurmError
from hpcserve.slurm.parse import JobState, SlurmNode

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


class PoolManager:
    def __init__(
        self,
        config: PlatformConfig,
        slurm: SlurmClient,
        *,
        config_path: Path | None = None,
        metrics_registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        router_endpoint: str | None = "",
    ) -> None:
        """router_endpoint: "" means the config's; None runs without a router (tests)."""
        self.config = config
        self.config_path = config_path
        self.slurm = slurm
        self.memory = PoolMemory()
        self.failures = FailureTracker(config.poolmgr.healthy_after_s)
        registry = metrics_registry or CollectorRegistry()
        self.metrics = PoolMgrMetrics(registry)
        self.cost_gauges = CostGauges(registry)
        # GPU-hours for `hpcserve report` where Slurm keeps no accounting (local jobs'
        # numbers restart with each run: nothing to account)
        self.job_records = (
            JobRecords(config.state_dir) if config.poolmgr.launcher == "slurm" else None
        )
        fetch = functools.partial(list_health_events, curve_dir=config.router.curve_dir)
        self.node_health = NodeHealthActions(slurm, registry, fetch=fetch)
        self.batch_pools = BatchPools(registry)
        check_capacities(config)  # autoscale.capacity: the planner can answer (ConfigError)
        self.autoscaled = AutoscaledPools(registry, Path(config.state_dir))
        # Each pool's cold start from its own jobs, kept in the state dir (cold_start.py).
        self.cold_starts = ColdStarts(Path(config.state_dir), registry)
        self._clock = clock
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._router_endpoint = router_endpoint
        self._replicas: list[ReplicaInfo] = []
        self._replicas_fresh = False  # the last ListReplicas answered (autoscaling needs it)
        self._unserved: dict[str, float] = {}  # model -> age of its last Route with no replica
        self._unserved_refs: dict[str, float] = {}  # the same per registry version
        # Each pool's registry version: an alias's or adapter's demand wakes it (wake_names.py).
        self.pool_versions = PoolVersions(config.registry_path())
        self._nodes: list[SlurmNode] = []
        self.cache_inventory = CacheInventory()
        self.pin_watch = PinWatch(config.poolmgr.pin_wait_s)
        self.registry_usage = RegistryUsage(config.registry_path())
        # Golden records as files for the engines' numerical canaries (canary_records.py).
        self.canary_records = CanaryRecords(config.state_dir, config.registry_path())
        targets_file = config.poolmgr.scrape_targets_file
        self.scrape_targets = ScrapeTargetsFile(Path(targets_file)) if targets_file else None
        self.job_states = JobStates()
        self.last_observation: Observation | None = None
        # Node -> leaf switch for the router's decode locality (poolmgr/switches.py).
        self.switch_topology = SwitchTopology(
            lambda: self.slurm.topology(), on_error=self._topology_failed
        )
        # Staged rollouts: a loop of its own beside this one (poolmgr/rollout_controller.py).
        self.rollouts = RolloutController(config, metrics_registry=registry, clock=clock)

    @property
    def state_dir(self) -> Path:
        return Path(self.config.state_dir)

    @property
    def prefix(self) -> str:
        return self.config.poolmgr.job_name_prefix

    def desired(self, overrides: dict[str, int] | None = None) -> dict[str, int]:
        if overrides is None:
            overrides = read_overrides(self.state_dir)
        return {pool.name: overrides.get(pool.name, pool.replicas) for pool in self.config.pools}

    def timing(self) -> Timing:
        cfg = self.config
        return Timing(
            min_submit_interval_s=cfg.poolmgr.min_submit_interval_s,
            drain_deadline_s=cfg.slurm.drain_s + 60,
            handover_lead_s=cfg.poolmgr.handover_lead_s,
            max_backoff_s=cfg.poolmgr.max_backoff_s,
        )

    # -- observing ---------------------------------------------------------------------------

    def _read_replicas(self) -> list[ReplicaInfo]:
        endpoint = self._router_endpoint
        if endpoint is None:
            return []
        try:
            switches = self.switch_topology.for_router(self._clock())
            listing = replica_list(
                endpoint or self.config.router.gateways_dial(),
                curve_dir=self.config.router.curve_dir,
                node_switches=switches,
            )
            self.switch_topology.answered(switches, listing.epoch)
            self._replicas = listing.replicas
            self._unserved = listing.unserved
            self._unserved_refs = listing.unserved_refs
            for replica in self._replicas:
                self.cache_inventory.report(replica.node, replica.cached)
            self.registry_usage.sync(self._replicas)
            self.canary_records.sync(
                (r.model_ref for r in self._replicas if r.model_ref), self._clock()
            )
            if self.scrape_targets is not None:
                self.scrape_targets.update(self._replicas)
            self._replicas_fresh = True
        except RouterQueryError as err:
            self._replicas_fresh = False
            log.warning("router unavailable, using the last known replicas: %s", err)
        return self._replicas

    def _wake_demand(self, now: float) -> dict[str, float]:
        """The router's unserved demand by served name, an alias's or a LoRA adapter's
        counted for the pool serving its version (poolmgr/wake_names.py)."""
        if not self._unserved_refs:
            return self._unserved
        pools = [p for p in self.config.pools if p.autoscale is not None]
        self.pool_versions.registry_path = Path(self.config.registry_path())  # after a reload
        versions = self.pool_versions.of(pools, now)
        return demand_by_model(pools, self._unserved, self._unserved_refs, versions)

    def _topology_failed(self, err: Exception) -> None:
        self.metrics.errors.labels("topology").inc()
        log.warning("cannot read the switch topology, keeping the last known: %s", err)

    def _read_nodes(self) -> list[SlurmNode]:
        try:
            self._nodes = self.slurm.nodes()
        except SlurmError as err:
            self.metrics.errors.labels("nodes").inc()
            log.warning("cannot read node states, using the last known: %s", err)
        return self._nodes

    def observe(self) -> Observation:
        snapshot = self.slurm.jobs(name_prefix=self.prefix + "-")
        digests = {pool.name: pool_spec_digest(self.config, pool) for pool in self.config.pools}
        observation = observe(snapshot.jobs, self._read_replicas(), self._read_nodes(), digests)
        transitions = self.job_states.observe(observation.ours)
        self._log_state_changes(transitions)
        self.cost_gauges.update(self.config, observation.ours)
        if self.job_records is not None:
            self.job_records.update(self.config, transitions, self._clock())
        if self._replicas_fresh:
            self.cold_starts.observe(observation.ours, self._replicas, self._clock())
        for line in self.failures.update(transitions, observation.serving_job_ids, self._clock()):
            log.warning(line)
        self.memory.failures = self.failures.failures
        active = {j.job_id for j in observation.jobs}
        for job_id in list(self.memory.draining_since):
            if job_id not in active:
                del self.memory.draining_since[job_id]
        self.last_observation = observation
        return observation

    def _log_state_changes(self, transitions: list[Transition]) -> None:
        counts: dict[tuple[str, str], int] = {}
        for transition in transitions:
            job, identity, before = transition.job, transition.identity, transition.before
            if transition.changed:
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
        self.metrics.jobs.clear()
        for (pool, state), n in counts.items():
            self.metrics.jobs.labels(pool, state).set(n)

    def poll_once(self) -> Plan | None:
        started = time.perf_counter()
        if self._reload.is_set():
            self._reload.clear()
            self.reload()
        # Before observing: nodes drained now are seen drained, so nothing new goes there.
        self._act_on_health()
        try:
            observation = self.observe()
        except SlurmError as err:
            self.metrics.errors.labels("squeue").inc()
            log.warning("cannot read job states, retrying next poll: %s", err)
            return None
        now = self._clock()
        observation = self._retire_stranded_pins(observation, now)
        overrides = read_overrides(self.state_dir)
        # Autoscaled interactive pools: their target from their load (poolmgr/autoscale.py),
        # on a compressed day's clock in a rehearsal (poolmgr/rehearsal_clock.py).
        clock = RehearsalClock.of(self.config.poolmgr)
        self.autoscaled.speedup = clock.speedup
        desired = self.autoscaled.resize(
            self.config, self.desired(overrides), overrides, observation.jobs,
            self.memory.draining_since, self._replicas if self._replicas_fresh else None,
            observation.admin_serving, clock.now(now),
            unserved={m: clock.stretch(a) for m, a in self._wake_demand(now).items()},
            lead_s={p: clock.stretch(s) for p, s in self.cold_starts.leads().items()},
        )  # fmt: skip
        desired = self.batch_pools.resize(
            self.config, desired, observation.jobs, self.memory.draining_since,
            self._nodes, now,
        )  # fmt: skip
        # A full partition: a replica from a pool of lower priority (poolmgr/gpu_take.py).
        desired = self.autoscaled.take_gpus(
            self.config, desired, observation.jobs, self.memory.draining_since,
            {job.job_id: job.state_reason for job, _ in observation.ours
             if job.state is JobState.PENDING},
            overrides, now,
        )  # fmt: skip
        for name, want in desired.items():
            self.metrics.desired.labels(name).set(want)
        plan = reconcile(
            desired,
            observation.jobs,
            self.memory,
            now=now,
            timing=self.timing(),
            admin_serving=observation.admin_serving,
        )
        for action in plan.actions:
            self.metrics.actions.labels(type(action).__name__.lower(), action.pool).inc()
            match action:
                case Submit():
                    self._submit(self.config.pool(action.pool), action.count, now)
                case Drain():
                    self._drain(action, now)
                case Cancel():
                    self._cancel(action)
        self._write_status(desired, observation, plan, now)
        self.metrics.poll_seconds.set(time.perf_counter() - started)
        return plan

    def _retire_stranded_pins(self, observation: Observation, now: float) -> Observation:
        """A pending replica pinned to a node (placement by cache) that has waited for it
        (down, drained, or busy: it lost the race) for poolmgr.pin_wait_s is retired like a
        job on a bad node: cancelled, and replaced by one that placement does not pin there."""
        pinned_by_us = [
            job
            for job, ident in observation.ours
            if ident.pool in self._pool_names
            and not chooses_nodes(
                [*self.config.slurm.extra_args, *self.config.pool(ident.pool).sbatch_args]
            )
        ]
        self.pin_watch.wait_s = self.config.poolmgr.pin_wait_s
        known = set(self.pin_watch.since)
        stranded = self.pin_watch.stranded(pinned_by_us, self._nodes, now)
        why = {job.job_id: job.state_reason for job in pinned_by_us}
        for job_id in self.pin_watch.since.keys() - known:
            log.info("job %d waits for its pinned node (%s)", job_id, why.get(job_id, "?"))
        if not stranded:
            return observation
        for job_id, nodes in stranded.items():
            log.warning(
                "job %d: waited for pinned node %s (%s) for %gs or more; replacing it unpinned",
                job_id,
                ",".join(nodes),
                why.get(job_id, "?"),
                self.pin_watch.wait_s,
            )
        jobs = [
            dataclasses.replace(job, on_bad_node=True) if job.job_id in stranded else job
            for job in observation.jobs
        ]
        return dataclasses.replace(observation, jobs=jobs)

    @property
    def _pool_names(self) -> set[str]:
        return {pool.name for pool in self.config.pools}

    def _act_on_health(self) -> None:
        if self._router_endpoint is None:
            return
        endpoint = self._router_endpoint or self.config.router.gateways_dial()
        for job_id in self.node_health.poll(endpoint, self.config.health):
            # The job drains itself (its engine left routing): replace it now.
            self.memory.draining_since.setdefault(job_id, self._clock())

    def _write_status(
        self, desired: dict[str, int], observation: Observation, plan: Plan, now: float
    ) -> None:
        lead = self.config.poolmgr.handover_lead_s
        pools = []
        for pool in self.config.pools:
            jobs = [j for j in observation.jobs if j.pool == pool.name]
            draining = [j for j in jobs if j.job_id in self.memory.draining_since]
            retiring = [j for j in jobs if j not in draining and retire_reason(j, now, lead)]
            live = [j for j in jobs if j not in draining and j not in retiring]
            pending = [
                f"job {job.job_id}: {job.state_reason}"
                for job, ident in observation.ours
                if ident.pool == pool.name and job.state is JobState.PENDING
            ]
            next_at = plan.next_submit_at.get(pool.name)
            pools.append(PoolStatus(
                pool=pool.name, model=pool.model, desired=desired[pool.name], live=len(live),
                serving=sum(1 for j in live if j.serving), admin=observation.admin_serving.get(
                    pool.name, 0), draining=len(draining), retiring=len(retiring),
                pending=pending, failures=self.failures.failures.get(pool.name, 0),
                last_failure=self.failures.last_failure.get(pool.name, ""),
                next_submit_in_s=round(max(next_at - now, 0), 1) if next_at else None,
                role=pool.role, max_replicas=pool.max_replicas,
                backlog=self.batch_pools.pool_backlog.get(pool.name) if is_elastic(pool) else None,
                autoscale=self._autoscale_status(pool.name),
                cold_start=est.describe() if (est := self.cold_starts.estimate(pool.name)) else "",
            ))  # fmt: skip
        status = PoolMgrStatus(updated_at=now, pools=pools, unmanaged_pools=plan.unmanaged_pools)
        try:
            write_status(self.state_dir, status)
        except OSError as err:
            log.warning("cannot write the status file in %s: %s", self.state_dir, err)

    def _autoscale_status(self, pool: str) -> AutoscaleStatus | None:
        decision = self.autoscaled.decisions.get(pool)
        signals = self.autoscaled.signals.get(pool)
        auto = self.config.pool(pool).autoscale
        if decision is None or signals is None or auto is None:
            return None
        return AutoscaleStatus(
            target=decision.target,
            min=auto.min,
            max=auto.max,
            signals=signals.summary(),
            last_reason=decision.state.last_reason,
            now=decision.reason,
            capacity=signals.capacity_text(auto.target_in_flight, auto.max_waiting_per_replica),
        )

    # -- acting ------------------------------------------------------------------------------

    def _submit(self, pool: PoolConfig, count: int, now: float) -> None:
        self.memory.last_submit[pool.name] = now
        try:
            # Job output (vLLM's log) owner-only; the engines' token made if none is there yet.
            private_dir(job_log_dir(self.config))
            ensure_token(self.config.engine_token_path())
        except (OSError, EngineTokenError) as err:
            log.error("pool %s: cannot prepare the job's files: %s", pool.name, err)
            return
        try:
            model = resolve_model(self.config, pool)
        except (RegistryError, OSError) as err:
            log.error("pool %s: cannot resolve model %r: %s", pool.name, pool.model_ref, err)
            return
        # Prefer nodes whose cache holds the model (poolmgr/placement.py).
        pins = job_pins(
            self.cache_inventory,
            Path(model.manifest).stem if model.manifest else "",
            self._nodes,
            jobs=count,
            gpus_per_job=pool.gpus_per_replica,
            nodes_per_job=pool.nodes_per_replica,
            partition=job_partition(self.config, pool),
            sbatch_args=[*self.config.slurm.extra_args, *pool.sbatch_args],
            avoid=self.pin_watch.avoided(now),
        )
        for pin in pins:
            script = render(build_job_spec(self.config, pool, model))
            pin_args = [f"--nodelist={pin}"] if pin else []
            try:
                job_id = self.slurm.submit(
                    script,
                    extra_args=[*self.config.slurm.extra_args, *pool.sbatch_args, *pin_args],
                )
            except SlurmError as err:
                self.metrics.errors.labels("sbatch").inc()
                log.error("pool %s: submission failed: %s", pool.name, err)
                return
            where = f" on {pin}, whose cache holds {model.model_ref}" if pin else ""
            log.info("pool %s: submitted job %d%s", pool.name, job_id, where)

    def _drain(self, action: Drain, now: float) -> None:
        try:
            self.slurm.cancel([action.job_id], signal="USR1", batch_only=True)
        except SlurmError as err:
            self.metrics.errors.labels("scancel").inc()
            log.error("pool %s: cannot signal job %d to drain: %s", action.pool, action.job_id, err)
            return
        self.memory.draining_since[action.job_id] = now
        log.info("pool %s: draining job %d (%s)", action.pool, action.job_id, action.reason)

    def _cancel(self, action: Cancel) -> None:
        try:
            self.slurm.cancel([action.job_id])
        except SlurmError as err:
            self.metrics.errors.labels("scancel").inc()
            log.error("pool %s: cannot cancel job %d: %s", action.pool, action.job_id, err)
            return
        log.info("pool %s: cancelled job %d (%s)", action.pool, action.job_id, action.reason)

    # -- lifecycle ---------------------------------------------------------------------------

    def request_reload(self) -> None:
        self._reload.set()

    def reload(self) -> bool:
        """Re-read the config file; on an error keep running with the old one."""
        if self.config_path is None:
            return False
        try:
            config = load_config(self.config_path)
            check_capacities(config)
        except ConfigError as err:
            log.error("reload refused, keeping the running config: %s", err)
            return False
        changed = [p.name for p in config.pools if p not in self.config.pools]
        self.config = config
        self.rollouts.config = config
        log.info(
            "config reloaded from %s; pools changed: %s",
            self.config_path,
            ", ".join(changed) or "none",
        )
        return True

    def stop(self) -> None:
        self._stop.set()

    def run_forever(self) -> None:
        private_dir(self.state_dir)
        ensure_token(self.config.engine_token_path())
        log.info(
            "pool manager started: %s",
            ", ".join(f"{p.name}={p.replicas}" for p in self.config.pools) or "no pools",
        )
        rollouts = self.rollouts.start(self._stop)
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.config.poolmgr.poll_s)
        rollouts.join(self.config.rollout.metrics_timeout_s + 5)
        log.info("pool manager stopped")
