"""The platform config: one TOML file, typed with msgspec, validated once at start.

Every error names the key, the bad value and what is allowed, e.g.
``pools[0].replicas: expected int >= 0, got -1``. The running components take
the parsed objects; nothing re-reads the file behind their back.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal, get_args

import msgspec

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
# What clients put in "model": HF-style names such as org/model-8b are allowed.
ModelName = Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z0-9][A-Za-z0-9._/:-]{0,127})?$")]

EngineKind = Literal["vllm", "vllm-cpu", "sim"]
Launcher = Literal["slurm", "local"]


class ConfigError(ValueError):
    pass


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Engines connect to registry_endpoint; gateways connect to routing_endpoint.
    registry_bind: str = "tcp://127.0.0.1:5560"
    routing_bind: str = "tcp://127.0.0.1:5561"
    registry_endpoint: str = ""  # what engines dial; defaults to registry_bind
    routing_endpoint: str = ""  # what gateways dial; defaults to routing_bind
    lease_s: PosFloat = 6.0
    heartbeat_s: PosFloat = 2.0
    metrics_port: Port = 9101

    def engines_dial(self) -> str:
        return self.registry_endpoint or self.registry_bind

    def gateways_dial(self) -> str:
        return self.routing_endpoint or self.routing_bind


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    tenant: Name
    sha256: Sha256Hex


Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Priority = Literal["interactive", "batch"]
Overflow = Literal["never", "external"]


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What one tenant may do. Zero means unlimited for every limit."""

    name: Name
    # Model names (served names, aliases, adapters) the tenant may call; empty allows all.
    allowed_models: list[ModelName] = []
    requests_per_min: NonNegInt = 0
    # Prompt plus completion tokens, counted from the engines' usage.
    tokens_per_min: NonNegInt = 0
    max_concurrent: NonNegInt = 0
    # Tokens per minute for this tenant's batch jobs (the Batch API), apart from interactive.
    batch_tokens_per_min: NonNegInt = 0
    priority: Priority = "interactive"
    # "external": when no replica can take a request in time, send it to gateway.overflow.
    overflow: Overflow = "never"
    # Data must stay on this site's GPUs: never overflowed, whatever `overflow` says.
    data_resident: bool = False


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    # An upstream engine that sends nothing for this long fails the request with 504.
    upstream_timeout_s: PosFloat = 600.0
    # How long a request may wait for the router's answer before 503.
    route_timeout_s: PosFloat = 2.0
    max_body_bytes: PosInt = 4 * 1024 * 1024
    api_keys: list[ApiKey] = []
    # sha256 of admin keys (admin endpoints, every tenant's batches and files); never tenant keys.
    admin_keys: list[Sha256Hex] = []
    # Tenants named by api_keys; when this list is empty every tenant gets the defaults.
    tenants: list[TenantConfig] = []


class SlurmConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit_min: PosInt = 60
    # Seconds before the time limit that Slurm sends USR1 to the batch shell: the drain window.
    drain_s: PosInt = 60
    extra_args: list[str] = []
    # SLURM_CONF for every Slurm command; empty means Slurm's default lookup.
    conf: str = ""
    log_dir: str = ""


class PoolMgrConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    poll_s: PosFloat = 5.0
    # At most one submission per pool per this many seconds, so a crash loop cannot flood slurmctld.
    min_submit_interval_s: PosFloat = 2.0
    job_name_prefix: Name = "hpcserve"
    launcher: Launcher = "slurm"
    metrics_port: Port = 9102
    # A successor is submitted this long before a replica's time limit, so it serves before
    # the old one must stop: engine start-up time plus slurm.drain_s, with margin.
    handover_lead_s: NonNegFloat = 900.0
    # Repeated failures of a pool space its submissions out exponentially, up to this.
    max_backoff_s: PosFloat = 600.0
    # A replica that has served this long resets its pool's failure count.
    healthy_after_s: PosFloat = 120.0


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: Name
    # Where the weights are: a directory on a shared filesystem, or (model_ref) a version or
    # alias in the model registry, whose weights are then staged into engine.cache_dir.
    model_path: str = ""
    model_ref: str = ""
    served_model_name: ModelName = ""
    replicas: NonNegInt = 1
    gpus_per_replica: NonNegInt = 1  # per node of a replica
    # A replica across several nodes (vLLM's multi-node TP/PP, one `srun` task per node):
    # slurm_templates/engine-multinode.sbatch instead of engine.sbatch.
    nodes_per_replica: PosInt = 1
    tensor_parallel: PosInt = 1
    pipeline_parallel: PosInt = 1
    engine: EngineKind = "vllm"
    engine_args: list[str] = []
    env: dict[str, str] = {}
    sbatch_args: list[str] = []

    @property
    def model(self) -> str:
        return self.served_model_name or self.name


class EngineHostConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # vLLM binds here inside the job; gateways reach it at advertise_host.
    bind_host: str = "0.0.0.0"
    advertise_host: str = ""  # default: the node's hostname
    ready_timeout_s: PosFloat = 900.0
    python: str = ""  # interpreter with vLLM; default: the one running hpcserve
    # Node-local directory (NVMe) that registry models are staged into before vLLM starts.
    cache_dir: str = ""


class PlatformConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    state_dir: str = ".state"
    # The model registry (SQLite on the control node); default: <state_dir>/registry.sqlite3.
    registry: str = ""
    router: RouterConfig = RouterConfig()
    gateway: GatewayConfig = GatewayConfig()
    slurm: SlurmConfig = SlurmConfig()
    poolmgr: PoolMgrConfig = PoolMgrConfig()
    engine: EngineHostConfig = EngineHostConfig()
    pools: list[PoolConfig] = []

    def registry_path(self) -> str:
        return self.registry or str(Path(self.state_dir) / "registry.sqlite3")

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        allowed = ", ".join(p.name for p in self.pools) or "none configured"
        raise ConfigError(f"unknown pool {name!r}; pools: {allowed}")


_PATH_RE = re.compile(r"`\$\.?(?P<path>[^`]*)`")
_STEP_RE = re.compile(r"\.?([^.\[]+)|\[(\d+)\]")
_MISSING = object()
_CHOICES = {"engine": get_args(EngineKind), "launcher": get_args(Launcher)}


def _value_at(data: object, path: str) -> object:
    for name, index in _STEP_RE.findall(path):
        try:
            data = data[int(index)] if index else data[name]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


def humanize_validation_error(err: msgspec.ValidationError, data: object) -> str:
    """'Expected `int` >= 0 - at `$.pools[0].replicas`' -> 'pools[0].replicas: expected ...'."""
    head, sep, where = str(err).rpartition(" - at ")
    if not sep:
        head, path = str(err), ""
    else:
        match = _PATH_RE.match(where)
        path = match.group("path") if match else where
    detail = f"{head[0].lower()}{head[1:]}".replace("`", "")
    message = f"{path or '(top level)'}: {detail}"
    value = _value_at(data, path) if path else _MISSING
    # (Look in the detail only: "pools[0]" in the path must not pass for the value 0.)
    explained = ", got" in detail or "unknown field" in detail or repr(value) in detail
    if value is not _MISSING and not explained:
        message += f", got {value!r}"
    allowed = _CHOICES.get(path.rpartition(".")[2])
    if allowed and "invalid enum value" in message:
        message += f"; allowed: {', '.join(allowed)}"
    return message


def _check_parallelism(i: int, pool: PoolConfig) -> None:
    workers = pool.tensor_parallel * pool.pipeline_parallel
    nodes = pool.nodes_per_replica
    gpus = pool.gpus_per_replica * nodes
    if pool.engine == "vllm" and gpus != workers:
        # vLLM runs one worker per GPU, the same number on every node of a replica.
        raise ConfigError(
            f"pools[{i}].gpus_per_replica: {pool.gpus_per_replica} x nodes_per_replica "
            f"{nodes} = {gpus} GPU(s), but tensor_parallel x pipeline_parallel = "
            f"{pool.tensor_parallel} x {pool.pipeline_parallel} = {workers}; engine 'vllm' "
            "needs them equal (one GPU per worker)"
        )
    if pool.engine == "sim" and gpus < workers:
        raise ConfigError(
            f"pools[{i}].gpus_per_replica: {pool.gpus_per_replica} x nodes_per_replica "
            f"{nodes} = {gpus} is fewer than tensor_parallel x pipeline_parallel = {workers}"
        )
    if workers % nodes:
        raise ConfigError(
            f"pools[{i}].nodes_per_replica: {nodes} does not divide tensor_parallel x "
            f"pipeline_parallel = {workers} (each node runs the same number of workers)"
        )


def _check_semantics(cfg: PlatformConfig) -> None:
    seen: set[str] = set()
    for i, pool in enumerate(cfg.pools):
        if pool.name in seen:
            raise ConfigError(f"pools[{i}].name: {pool.name!r} is used by an earlier pool")
        seen.add(pool.name)
        if bool(pool.model_path) == bool(pool.model_ref):
            raise ConfigError(
                f"pools[{i}]: set exactly one of model_path (a directory) and model_ref (a "
                f"registry version or alias); got model_path={pool.model_path!r}, "
                f"model_ref={pool.model_ref!r}"
            )
        if pool.model_ref and not cfg.engine.cache_dir:
            raise ConfigError(
                f"pools[{i}].model_ref: {pool.model_ref!r} needs engine.cache_dir, the "
                "node-local directory the model is staged into"
            )
        _check_parallelism(i, pool)
        if pool.nodes_per_replica > 1 and cfg.poolmgr.launcher == "local":
            raise ConfigError(
                f"pools[{i}].nodes_per_replica: {pool.nodes_per_replica} needs "
                "poolmgr.launcher = 'slurm' (the local launcher runs a replica as one local "
                "process)"
            )
    _check_tenants(cfg.gateway)
    if cfg.router.heartbeat_s * 2 > cfg.router.lease_s:
        raise ConfigError(
            f"router.lease_s: {cfg.router.lease_s} must be at least twice "
            f"router.heartbeat_s ({cfg.router.heartbeat_s}), or one late heartbeat drops a replica"
        )
    limit_s = cfg.slurm.time_limit_min * 60
    if cfg.poolmgr.handover_lead_s + cfg.slurm.drain_s >= limit_s:
        raise ConfigError(
            f"poolmgr.handover_lead_s: {cfg.poolmgr.handover_lead_s:g} plus slurm.drain_s "
            f"({cfg.slurm.drain_s}) must be less than slurm.time_limit_min ({limit_s} s), or "
            "every replica is replaced as soon as it starts"
        )
    models = [p.model for p in cfg.pools]
    for model in models:
        if models.count(model) > 1:
            raise ConfigError(f"pools: model {model!r} is served by two pools; give each its own")


def _check_tenants(gateway: GatewayConfig) -> None:
    declared: set[str] = set()
    for i, tenant in enumerate(gateway.tenants):
        if tenant.name in declared:
            raise ConfigError(
                f"gateway.tenants[{i}].name: {tenant.name!r} is used by an earlier tenant"
            )
        declared.add(tenant.name)
        if tenant.data_resident and tenant.overflow != "never":
            raise ConfigError(
                f"gateway.tenants[{i}]: {tenant.name!r} is data_resident, so its overflow must "
                f"be 'never', not {tenant.overflow!r}"
            )
    if declared:
        for i, key in enumerate(gateway.api_keys):
            if key.tenant not in declared:
                raise ConfigError(
                    f"gateway.api_keys[{i}].tenant: {key.tenant!r} is not one of "
                    f"gateway.tenants ({', '.join(sorted(declared))})"
                )
    tenant_digests = {k.sha256 for k in gateway.api_keys}
    for i, digest in enumerate(gateway.admin_keys):
        if digest in tenant_digests:
            raise ConfigError(
                f"gateway.admin_keys[{i}]: this key is also a tenant key; "
                "admin keys must be separate"
            )


def parse_config(data: dict[str, object], *, source: str = "config") -> PlatformConfig:
    try:
        cfg = msgspec.convert(data, PlatformConfig)
    except msgspec.ValidationError as err:
        raise ConfigError(f"{source}: {humanize_validation_error(err, data)}") from None
    try:
        _check_semantics(cfg)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return cfg


def load_config(path: Path) -> PlatformConfig:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    cfg = parse_config(data, source=str(path))
    if not Path(cfg.state_dir).is_absolute():
        cfg = msgspec.structs.replace(cfg, state_dir=str((path.parent / cfg.state_dir).resolve()))
    return cfg


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def dump_config(cfg: PlatformConfig) -> str:
    """TOML text for a config (used by `hpcserve up` to write the demo config)."""
    return _to_toml(msgspec.to_builtins(cfg))


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else msgspec.json.encode(key).decode()


def _to_toml(data: dict[str, object]) -> str:
    lines: list[str] = []
    tables: list[tuple[str, dict[str, object]]] = []
    arrays: list[tuple[str, list[dict[str, object]]]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, table in tables:
        sub_arrays = {
            k: v
            for k, v in table.items()
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
        }
        lines.append(f"\n[{key}]")
        for k, v in table.items():
            if k not in sub_arrays:
                lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        for k, items in sub_arrays.items():
            for item in items:
                lines.append(f"\n[[{key}.{k}]]")
                lines.extend(f"{_toml_key(ik)} = {_toml_value(iv)}" for ik, iv in item.items())
    for key, items in arrays:
        for item in items:
            lines.append(f"\n[[{key}]]")
            lines.extend(f"{_toml_key(ik)} = {_toml_value(iv)}" for ik, iv in item.items())
    return "\n".join(lines) + "\n"
