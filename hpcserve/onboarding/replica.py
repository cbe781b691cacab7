"""A replica of one registry version to evaluate: one already serving it, or one started for
the evaluation as a Slurm job of a canary pool.

The canary pool is a configured pool (`--pool`) whose replica shape (GPUs, engine, engine
arguments, environment, sbatch arguments) the job takes, serving the version under its own
served name `eval-<model>-<version>`. The job is rendered and submitted by the pool
manager's own code (poolmgr/spec.py, poolmgr/render.py, the one Slurm client), so it is the
job the pool manager would submit; the running pool manager reports it among its unmanaged
pools and leaves it alone. The evaluation drains it when done (USR1 to the batch shell, as
a scale-down does), and cancels it if it does not end in time.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from hpcserve.config import PlatformConfig, PoolConfig
from hpcserve.contracts.engine_token import EngineTokenError, auth_headers, ensure_token, read_token
from hpcserve.contracts.private_files import private_dir
from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.contracts.router_client import RouterQueryError, list_replicas
from hpcserve.modelcache.refs import parse_ref
from hpcserve.poolmgr.launchers import make_launcher
from hpcserve.poolmgr.render import render
from hpcserve.poolmgr.spec import build_job_spec, job_log_dir, resolve_model
from hpcserve.slurm.client import SlurmClient

Say = Callable[[str], None]


class ReplicaError(RuntimeError):
    """No replica of the version could be found or started; the message says why."""


@dataclass
class Target:
    ref: str
    model: str  # the served model name clients ask the gateway for
    replicas: list[ReplicaInfo] = field(default_factory=list)
    job_id: int = 0  # the canary job started for this evaluation; 0: one already serving
    engine_args: list[str] = field(default_factory=list)

    def describe(self) -> str:
        jobs = sorted({r.slurm_job_id for r in self.replicas if r.slurm_job_id})
        where = f" (job {', '.join(map(str, jobs))})" if jobs else ""
        started = ", started for this evaluation" if self.job_id else ", already serving"
        return f"{self.model}{where}{started}"


def _replicas(config: PlatformConfig) -> list[ReplicaInfo]:
    return list_replicas(
        config.router.gateways_dial(), timeout_s=5.0, curve_dir=config.router.curve_dir
    )


def find_serving(config: PlatformConfig, ref: str) -> Target | None:
    """A served model whose replicas all serve `ref` (the one with most replicas), or None."""
    by_model: dict[str, list[ReplicaInfo]] = {}
    everyone = _replicas(config)
    for r in everyone:
        by_model.setdefault(r.model, []).append(r)
    fits = [
        (len(rs), model) for model, rs in by_model.items() if all(r.model_ref == ref for r in rs)
    ]
    if not fits:
        return None
    _, model = max(fits)
    pool = next((p for p in config.pools if p.model == model), None)
    return Target(ref, model, by_model[model], engine_args=_engine_args(config, pool, ref))


def canary_pool(config: PlatformConfig, template: str, ref: str) -> PoolConfig:
    """The configured pool `template`, one replica serving `ref` as `eval-<model>-<version>`."""
    pool = config.pool(template)
    name, version = parse_ref(ref)
    served = re.sub(r"[^A-Za-z0-9._-]", "-", f"eval-{name}-{version}")[:63]
    return msgspec.structs.replace(
        pool,
        name=served,
        served_model_name=served,
        model_path="",
        model_ref=ref,
        replicas=1,
        autoscale=None,
        max_replicas=0,
        role="interactive",
        max_loras=0,
        lora_adapters=[],
    )


def _engine_args(config: PlatformConfig, pool: PoolConfig | None, ref: str) -> list[str]:
    """The vLLM arguments a replica of `pool` serving `ref` gets (the version's, the pool's)."""
    if pool is None:
        from hpcserve.modelcache.registry import Registry

        with Registry(Path(config.registry_path())) as registry:
            return list(registry.version(ref).engine_args)
    pinned = msgspec.structs.replace(pool, model_path="", model_ref=ref)
    return list(build_job_spec(config, pinned, resolve_model(config, pinned)).engine_args)


def start_canary(
    config: PlatformConfig, pool: PoolConfig, say: Say, *, slurm: SlurmClient | None = None
) -> tuple[SlurmClient, int]:
    """Submit one replica of canary pool `pool`; (the Slurm client, the job id)."""
    private_dir(job_log_dir(config))
    ensure_token(config.engine_token_path())
    model = resolve_model(config, pool)
    spec = build_job_spec(config, pool, model)
    slurm = slurm or make_launcher(config)
    job_id = slurm.submit(render(spec), extra_args=[*config.slurm.extra_args, *pool.sbatch_args])
    say(f"submitted job {job_id}: a replica of {pool.model_ref} as {pool.model} (canary pool)")
    return slurm, job_id


def wait_serving(
    config: PlatformConfig,
    slurm: SlurmClient,
    job_id: int,
    pool: PoolConfig,
    say: Say,
    *,
    timeout_s: float,
    poll_s: float = 2.0,
) -> Target:
    """Wait until job `job_id`'s replica serves (registered with the router)."""
    started = time.monotonic()
    next_report = started + 30
    while True:
        try:
            mine = [r for r in _replicas(config) if r.slurm_job_id == job_id]
        except RouterQueryError as err:
            say(f"router not answering yet: {err}")
            mine = []
        if mine:
            say(f"job {job_id} serves {pool.model_ref} after {time.monotonic() - started:.0f}s")
            args = _engine_args(config, pool, pool.model_ref)
            return Target(pool.model_ref, pool.model, mine, job_id=job_id, engine_args=args)
        jobs = {j.job_id: j for j in slurm.jobs().jobs}
        job = jobs.get(job_id)
        if job is not None and not job.state.is_active:
            log = job_log_dir(config) / f"{config.poolmgr.job_name_prefix}-{pool.name}-{job_id}.out"
            raise ReplicaError(
                f"job {job_id} ended ({job.state.name}) before its replica served; see {log}"
            )
        now = time.monotonic()
        if now - started > timeout_s:
            raise ReplicaError(
                f"job {job_id} did not serve {pool.model_ref} within {timeout_s:g}s "
                "(--start-timeout)"
            )
        if now >= next_report:
            state = job.state.name if job is not None else "not listed"
            say(f"  {now - started:4.0f}s: job {job_id} {state}")
            next_report = now + 30
        time.sleep(poll_s)


def stop_canary(
    config: PlatformConfig, slurm: SlurmClient, job_id: int, say: Say, *, poll_s: float = 1.0
) -> None:
    """Drain the job (USR1 to its batch shell), cancel it if it outlives the drain window,
    and return once Slurm reports it ended."""

    def active() -> bool:
        job = next((j for j in slurm.jobs().jobs if j.job_id == job_id), None)
        return job is not None and job.state.is_active

    slurm.cancel([job_id], signal="USR1", batch_only=True)
    say(f"draining job {job_id}")
    deadline = time.monotonic() + config.slurm.drain_s + 30
    while active():
        if time.monotonic() > deadline:
            say(f"job {job_id} did not drain in time; cancelling it")
            slurm.cancel([job_id])
            deadline = time.monotonic() + 60
        time.sleep(poll_s)
    say(f"job {job_id} ended")


def engine_version(config: PlatformConfig, target: Target) -> str:
    """The engine's own version (vLLM's GET /version) of the target's first replica."""
    if not target.replicas:
        return "unknown"
    try:
        token = read_token(config.engine_token_path())
    except EngineTokenError:
        token = ""
    request = urllib.request.Request(
        target.replicas[0].url.rstrip("/") + "/version", headers=auth_headers(token)
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            version = json.loads(resp.read()).get("version", "")
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return "unknown"
    return f"vllm {version}" if version else "unknown"
