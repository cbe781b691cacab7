"""What a replica of a pool is: its job script values and a digest of them (pure)."""

from __future__ import annotations

import hashlib
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from hpcserve.config import HealthConfig, PlatformConfig, PoolConfig
from hpcserve.contracts.engine_args import kv_transfer_args, scheduling_args, tool_call_args
from hpcserve.contracts.engine_token import FILE_ENV
from hpcserve.poolmgr.identity import new_identity
from hpcserve.poolmgr.render import JobSpec
from hpcserve.poolmgr.state_files import write_atomic


def hpcserve_executable() -> str:
    """The `hpcserve` console script next to this interpreter (the job runs the same install)."""
    beside = Path(sys.executable).with_name("hpcserve")
    if beside.exists():
        return str(beside)
    return shutil.which("hpcserve") or "hpcserve"


def job_log_dir(config: PlatformConfig) -> Path:
    return Path(config.slurm.log_dir or Path(config.state_dir) / "jobs")


def pool_spec_digest(config: PlatformConfig, pool: PoolConfig) -> str:
    """8 hex digits that change when anything shaping a replica of the pool changes.

    The replica count and the elastic sizing keys are left out: scaling a pool must not
    replace its replicas. Settings at their defaults are left out too, so a release that adds
    a setting (with a default that keeps today's behaviour) does not replace every running
    replica.
    """
    fields = _set_fields(msgspec.structs.replace(pool, replicas=0))
    sizing_keys = ("max_replicas", "backlog_per_replica", "scale_down_after_s", "autoscale")
    for sizing in (*sizing_keys, "priority"):
        fields.pop(sizing, None)
    shape = (
        fields,
        job_partition(config, pool), config.slurm.account, config.slurm.qos,
        config.slurm.time_limit_min, config.slurm.drain_s, config.slurm.extra_args,
        _set_fields(config.engine), config.router.engines_dial(),
    )  # fmt: skip
    return hashlib.sha256(msgspec.json.encode(shape)).hexdigest()[:8]


def job_partition(config: PlatformConfig, pool: PoolConfig) -> str:
    """The partition a pool's jobs go to: slurm.batch_partition for a batch pool, if set."""
    if pool.role == "batch" and config.slurm.batch_partition:
        return config.slurm.batch_partition
    return config.slurm.partition


def _set_fields(struct: msgspec.Struct) -> dict[str, Any]:
    """A config struct's fields that differ from their defaults (nested structs alike)."""
    out: dict[str, Any] = {}
    for field in msgspec.structs.fields(struct):
        value = getattr(struct, field.name)
        if isinstance(value, msgspec.Struct):
            value = _set_fields(value)
            if value:
                out[field.name] = value
            continue
        if field.default is not msgspec.NODEFAULT:
            default = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        else:
            out[field.name] = value
            continue
        if value != default:
            out[field.name] = value
    return out


@dataclass(frozen=True)
class ResolvedModel:
    model_path: str  # the weights' source directory
    engine_args: tuple[str, ...] = ()
    model_ref: str = ""  # name@version in the registry
    manifest: str = ""  # where its digest manifest was written for the job to read
    lora_plan: str = ""  # LoRA on: where the pool's LoRA plan was written for the job
    # Where the version's golden record is kept for the job (poolmgr/canary_records.py),
    # whether or not it has one yet.
    canary_record: str = ""


def resolve_model(config: PlatformConfig, pool: PoolConfig) -> ResolvedModel:
    """A pool's weights: its model_path, or its registry ref resolved to a version whose
    manifest is written (once) under <state_dir>/manifests for the job to stage from.
    Raises RegistryError naming the ref when the registry does not have it."""
    lora_plan = write_lora_plan(config, pool)
    if not pool.model_ref:
        return ResolvedModel(model_path=pool.model_path, lora_plan=lora_plan)
    from hpcserve.modelcache.refs import cache_key
    from hpcserve.modelcache.registry import Registry
    from hpcserve.poolmgr.canary_records import write_record_file

    registry = Registry(Path(config.registry_path()))
    try:
        version = registry.version(pool.model_ref)
        manifest = registry.manifest(version.ref)
        canary_record = write_record_file(registry, config.state_dir, version.ref)
    finally:
        registry.close()
    path = (
        Path(config.state_dir)
        / "manifests"
        / (cache_key(version.model, version.version, manifest.digest()) + ".json")
    )
    if not path.exists():
        write_atomic(path, manifest.encode())
    return ResolvedModel(
        model_path=version.source,
        engine_args=tuple(version.engine_args),
        model_ref=version.ref,
        manifest=str(path),
        lora_plan=lora_plan,
        canary_record=str(canary_record),
    )


def write_lora_plan(config: PlatformConfig, pool: PoolConfig) -> str:
    """For a pool with LoRA on: its plan (limits, and each static adapter's source and
    manifest from the registry) written under <state_dir>/lora for the job; "" when off.
    Raises RegistryError naming an adapter the registry does not have."""
    if pool.max_loras <= 0:
        return ""
    from hpcserve.contracts.lora_plan import LoraPlan, StaticAdapter
    from hpcserve.modelcache.registry import Registry, RegistryError

    with Registry(Path(config.registry_path())) as registry:
        base = registry.version(pool.model_ref).ref if pool.model_ref else ""
        for name in pool.lora_adapters:
            bound = registry.adapter(name).base_ref
            if base and bound != base:
                raise RegistryError(
                    f"pool {pool.name}: adapter {name} is bound to {bound}, the pool serves {base}"
                )
        adapters = [
            StaticAdapter(
                name, registry.adapter(name).path, registry.adapter_manifest(name).encode().decode()
            )
            for name in pool.lora_adapters
        ]
    plan = msgspec.json.encode(LoraPlan(pool.max_loras, pool.max_lora_rank, adapters))
    path = (
        Path(config.state_dir)
        / "lora"
        / f"{pool.name}-{hashlib.sha256(plan).hexdigest()[:12]}.json"
    )
    if not path.exists():
        write_atomic(path, plan)
    return str(path)


def build_job_spec(
    config: PlatformConfig, pool: PoolConfig, model: ResolvedModel | None = None
) -> JobSpec:
    """The values of one replica's job script; a fresh identity (nonce) each call."""
    model = model or ResolvedModel(model_path=pool.model_path or f"(registry: {pool.model_ref})")
    identity = new_identity(pool.name, pool.model, spec=pool_spec_digest(config, pool))
    return JobSpec(
        job_name=f"{config.poolmgr.job_name_prefix}-{pool.name}",
        comment=identity.comment(),
        gpus=pool.gpus_per_replica,
        nodes=pool.nodes_per_replica,
        time_limit_min=config.slurm.time_limit_min,
        drain_s=config.slurm.drain_s,
        hpcserve_bin=config.engine.hpcserve_bin or hpcserve_executable(),
        model_path=model.model_path,
        model=pool.model,
        router=config.router.engines_dial(),
        pool=pool.name,
        engine=pool.engine,
        tensor_parallel=pool.tensor_parallel,
        pipeline_parallel=pool.pipeline_parallel,
        bind_host=config.engine.bind_host,
        advertise_host=config.engine.advertise_host,
        heartbeat_s=config.router.heartbeat_s,
        cache_dir=config.engine.cache_dir if model.manifest else "",
        manifest=model.manifest,
        model_ref=model.model_ref,
        partition=job_partition(config, pool),
        account=config.slurm.account,
        qos=config.slurm.qos,
        output=str(job_log_dir(config) / "%x-%j.out"),
        engine_args=(
            *model.engine_args,
            *pool.engine_args,
            *scheduling_args(pool.scheduling_policy, (*model.engine_args, *pool.engine_args)),
            # After the registry version's arguments: the pool's parser wins over the version's.
            *tool_call_args(pool.tool_call_parser),
            # A prefill or decode pool's KV-transfer connector (docs/disaggregation.md).
            *kv_transfer_args(
                pool.role,
                pool.engine,
                (*model.engine_args, *pool.engine_args),
                pool.kv_transfer_dir,
            ),
        ),
        env=_job_env(pool, model)
        + _health_env(config)
        + _curve_env(config)
        + _token_env(config)
        + _private_network_env(config),
        launch_prefix=tuple(config.pool_launch_prefix(pool)),
        modules=tuple(config.pool_modules(pool)),
    )


def _token_env(config: PlatformConfig) -> tuple[tuple[str, str], ...]:
    """Where the engine reads the engine token (the path: the secret never enters the job's
    script or environment, which Slurm shows)."""
    return ((FILE_ENV, config.engine_token_path()),)


def _curve_env(config: PlatformConfig) -> tuple[tuple[str, str], ...]:
    """Where the engine finds its CURVE keys (contracts/curve.py); none in plain mode."""
    if not config.router.curve_dir:
        return ()
    return (("HPCSERVE_CURVE_DIR", config.router.curve_dir),)


def _private_network_env(config: PlatformConfig) -> tuple[tuple[str, str], ...]:
    """engine.private_network, read by `hpcserve engine --private-network`; none at auto."""
    mode = config.engine.private_network
    return () if mode == "auto" else (("HPCSERVE_PRIVATE_NETWORK", mode),)


def _health_env(config: PlatformConfig) -> tuple[tuple[str, str], ...]:
    """The job's health settings (read by the engine's monitor); none when all default."""
    if config.health == HealthConfig():
        return ()
    return (("HPCSERVE_HEALTH", msgspec.json.encode(config.health).decode()),)


def _job_env(pool: PoolConfig, model: ResolvedModel) -> tuple[tuple[str, str], ...]:
    env = dict(pool.env)
    if pool.role != "interactive":
        env["HPCSERVE_POOL_ROLE"] = pool.role  # read by `hpcserve engine --role`
    if model.lora_plan:
        env["HPCSERVE_LORA_PLAN"] = model.lora_plan  # read by `hpcserve engine --lora-plan`
    if model.canary_record:  # read by `hpcserve engine --canary-record`
        env["HPCSERVE_CANARY_RECORD"] = model.canary_record
    if pool.kv_transfer_dir:  # its engines sweep it (engine_launch/kv_janitor.py)
        env["HPCSERVE_KV_TRANSFER_TTL_S"] = f"{pool.kv_transfer_ttl_s:g}"
        env["HPCSERVE_KV_TRANSFER_MAX_MB"] = str(pool.kv_transfer_max_mb)
    return tuple(sorted(env.items()))
