"""The platform config: one TOML file, typed with msgspec, validated once at start.

Every error names the key, the bad value and what is allowed, e.g.
``pools[0].replicas: expected int >= 0, got -1``. The running components take
the parsed objects; nothing re-reads the file behind their back.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal, get_args

import msgspec

from hpcserve.contracts.engine_args import KV_TRANSFER_MAX_MB, KV_TRANSFER_TTL_S

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
# What clients put in "model": HF-style names such as org/model-8b are allowed.
ModelName = Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z0-9][A-Za-z0-9._/:-]{0,127})?$")]

# A word of a job's launch prefix (engine.launch_prefix) and an environment module's name.
LaunchWord = Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[^\n\r\x00]+$")]
ModuleName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+/@:-]{0,127}$")]

EngineKind = Literal["vllm", "vllm-cpu", "sim"]
Launcher = Literal["slurm", "local"]


class ConfigError(ValueError):
    pass


RoutingPolicy = Literal["kv-aware", "least-load", "round-robin"]


class RoutingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How the router picks a replica (router/policies/); see docs/architecture.md, Router."""

    # kv-aware: new prefill tokens + decode load + KV pressure (the default);
    # least-load and round-robin are the baselines.
    policy: RoutingPolicy = "kv-aware"
    # One request on a replica costs as much as this many prompt tokens to prefill (small:
    # a running request barely slows a batch; real overload is the overload gate's).
    tokens_per_request: PosFloat = 64.0
    # Overload gate: a replica more than overload_abs requests and overload_rel times above
    # the least loaded one gets no cache bonus.
    overload_abs: NonNegInt = 4
    overload_rel: PosFloat = 1.5
    # Share gate: in a fleet of n >= 3, a replica that took more than min(max_share,
    # share_factor / n) of the model's recent requests gets no cache bonus either (one
    # shared prompt spreads; max_share 1: off). share_factor: times the fair share 1/n.
    max_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.4
    share_factor: Annotated[float, msgspec.Meta(ge=1)] = 8.0
    # A cached prefix shorter than this earns no cache bonus: a template header every prompt
    # shares must not draw new contexts' full prefills to the replicas holding customers.
    min_prefix_tokens: NonNegInt = 64
    # Weight of the KV-pressure term, and a replica's KV capacity in tokens (0: use only the
    # engine's reported KV usage).
    kv_pressure_weight: NonNegFloat = 1.0
    kv_capacity_tokens: NonNegInt = 0
    # Subscribe to the engines' KV-cache events; a replica silent this long counts as cold.
    kv_events: bool = True
    kv_silence_s: PosFloat = 30.0
    # Approximate mode (engines without events): remember routed prefixes this long, at
    # most this many blocks per replica.
    approx_ttl_s: PosFloat = 120.0
    # A replica that publishes KV events holds a routed prompt's blocks as pending until
    # its BlockStored events confirm them, at most this long (router/approx_index.py), so
    # a customer's second request sent before the first one's prefill ends follows it
    # rather than starting a second prefill elsewhere; 0: off, the default: on 64 simulated
    # replicas it changed TTFT p90 within the noise, and recording a cold prompt's blocks at
    # routing time costs what ingesting them does (docs/benchmarks.md, router cost).
    pending_ttl_s: NonNegFloat = 0.0
    approx_max_blocks: PosInt = 100_000
    # Session affinity (header x-session-id): how long a session sticks to its replica.
    session_ttl_s: PosFloat = 600.0
    session_max: PosInt = 100_000
    # Batch pools (pools[].role = "batch"): a batch request may borrow an interactive replica
    # of its model only while nothing waits there and fewer than this many requests are on
    # it (router/policies/pool_roles.py). 0: never; batch requests stay on the batch pool.
    batch_lend_below: NonNegInt = 0


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Engines connect to registry_endpoint; gateways connect to routing_endpoint.
    registry_bind: str = "tcp://127.0.0.1:5560"
    routing_bind: str = "tcp://127.0.0.1:5561"
    registry_endpoint: str = ""  # what engines dial; defaults to registry_bind
    routing_endpoint: str = ""  # what gateways dial; defaults to routing_bind
    lease_s: PosFloat = 6.0
    heartbeat_s: PosFloat = 2.0
    metrics_port: Port = 9101
    routing: RoutingConfig = RoutingConfig()
    # CURVE keys: the registry socket, the KV relay socket and the routing socket all
    # authenticate and encrypt (engines hold the engine key, gateways, the batch runner and
    # the CLI the gateway key), loopback included: another user of the host reaches
    # 127.0.0.1 too. Empty: <state_dir>/curve, whose keys the router, gateway, batch runner
    # and pool manager make at start if absent (contracts/curve.py); keys in any other
    # directory are the site's (`hpcserve keys --dir`).
    curve_dir: str = ""
    # Plain sockets instead, by explicit choice only (logged as a warning at start):
    # allow_plain_loopback for loopback binds (a single-user machine), allow_plain_remote for
    # any bind (a demo on a private network). Ignored when curve_dir is set.
    allow_plain_remote: bool = False
    allow_plain_loopback: bool = False
    # Where engines' agents relay their vLLM's KV-cache events (engine_launch/kv_relay.py).
    # "": the registry_bind host on a free port; engines learn the address when they
    # register. kv_relay_endpoint: what they dial, when not registry_endpoint's host.
    kv_relay_bind: str = ""
    kv_relay_endpoint: str = ""
    # How often the router re-reads aliases and canary shares from the model registry
    # (router/aliases.py): `hpcserve models alias|promote` takes effect within this.
    alias_refresh_s: PosFloat = 2.0

    def engines_dial(self) -> str:
        return self.registry_endpoint or self.registry_bind

    def kv_relay_binds(self) -> str:
        """The KV relay socket's bind: kv_relay_bind, or registry_bind's host on a free port
        (ipc: a path beside the registry's)."""
        if self.kv_relay_bind:
            return self.kv_relay_bind
        if self.registry_bind.startswith("ipc://"):
            return self.registry_bind + ".kv"
        return self.registry_bind.rpartition(":")[0] + ":*"

    def kv_relay_dial(self, bound: str) -> str:
        """What engines dial for the relay socket bound at `bound` (its port resolved)."""
        if self.kv_relay_endpoint:
            return self.kv_relay_endpoint
        if bound.startswith("ipc://"):
            return bound
        return self.engines_dial().rpartition(":")[0] + ":" + bound.rpartition(":")[2]

    def gateways_dial(self) -> str:
        return self.routing_endpoint or self.routing_bind

    def plain(self) -> bool:
        """Plain sockets: no key directory, and the config asks for plain."""
        return not self.curve_dir and (self.allow_plain_loopback or self.allow_plain_remote)


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    tenant: Name
    sha256: Sha256Hex


Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Priority = Literal["interactive", "batch"]
Overflow = Literal["never", "external"]
SchedulingPolicy = Literal["fcfs", "priority"]
PoolRole = Literal["interactive", "batch", "prefill", "decode"]
BatchRunnerMode = Literal["standby", "process", "gateway"]


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
    # With overflow "external": overflow once every replica would queue the request longer
    # than this (seconds); 0: gateway.overflow.queue_budget_s.
    queue_budget_s: NonNegFloat = 0.0


class ExternalAPIConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An external OpenAI-compatible API that overflow traffic may be sent to."""

    # e.g. https://api.example.com/v1 (the endpoint path, /chat/completions, is appended).
    base_url: str = ""
    # Environment variable holding its API key (the key itself never goes in the config).
    api_key_env: str = ""
    # Our model name -> its model name; a model not listed here is never overflowed.
    models: dict[str, str] = {}
    timeout_s: PosFloat = 120.0
    # A request overflows when no replica could start it within this many seconds (the
    # router's estimate, router/queue_wait.py), or when there is no replica; 0: only then.
    queue_budget_s: NonNegFloat = 5.0


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    # An upstream engine that sends nothing for this long fails the request with 504.
    upstream_timeout_s: PosFloat = 600.0
    # Disaggregated prefill and decode (docs/disaggregation.md): a prefill step not answered
    # within this many seconds (connect, queue and compute together) is abandoned and the
    # decode replica computes the prompt itself. upstream_timeout_s is sized for a whole
    # generation; a one-token prefill that takes a minute means a backlogged or stuck
    # prefill replica, and the TTFT is lost anyway. The lower of the two applies.
    pd_prefill_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    # How long a request may wait for the router's answer before 503.
    route_timeout_s: PosFloat = 2.0
    # How often the gateway copies the router's replica set, which it routes on while the
    # router does not answer (gateway/replica_view.py); a copy older than the max age is
    # not used.
    replica_view_s: PosFloat = 2.0
    replica_view_max_age_s: PosFloat = 300.0
    max_body_bytes: PosInt = 4 * 1024 * 1024
    api_keys: list[ApiKey] = []
    # sha256 of admin keys (admin endpoints, every tenant's batches and files); never tenant keys.
    admin_keys: list[Sha256Hex] = []
    # Tenants named by api_keys; when this list is empty every tenant gets the defaults.
    tenants: list[TenantConfig] = []
    # How often each gateway sends its tenants' usage to the router and learns the others'
    # (router/quota_book.py): a limit can be overshot by about this much of others' traffic.
    quota_sync_s: PosFloat = 0.1
    # Where tenants with overflow = "external" go when no replica can take their request.
    overflow: ExternalAPIConfig = ExternalAPIConfig()
    # OpenTelemetry traces (OTLP over HTTP, e.g. http://collector:4318/v1/traces); empty: off.
    otlp_traces_endpoint: str = ""
    # Share of requests traced (a client's sampled traceparent is always followed): spans cost
    # CPU on every traced request (docs/benchmarks.md), so a busy gateway samples.
    trace_sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    # TLS for clients (sites without a reverse proxy): PEM certificate chain and key files,
    # both or neither; checked at the gateway's start (they exist and load).
    tls_cert: str = ""
    tls_key: str = ""
    # The audit log, one JSON line per request (time, tenant, key id, model, tokens, status,
    # request id; never prompt or completion text): "-" into the gateway's own log (stderr),
    # a file path (appended, mode 0600), or "" for none.
    audit_log: str = "-"
    # Usage records, one JSON line per served request (contracts/usage.py), the tokens that
    # `hpcserve report` counts; always written. Default: <state_dir>/usage.
    usage_dir: str = ""
    # The Responses API's stored responses (`store`, `previous_response_id`; gateway/
    # responses_store.py): SQLite under this directory, shared by every gateway of the site;
    # default: <state_dir>/responses.
    responses_dir: str = ""
    # How long a stored response stays retrievable and chainable (seconds; OpenAI keeps
    # them 30 days). Older ones are 404 and are deleted as the gateway writes new ones.
    responses_retention_s: PosFloat = 30 * 86400.0
    # The gateway's /metrics names tenants and their usage: it answers only requests that
    # present this file's token as a bearer token (made, 0600, at start if absent; default
    # <state_dir>/secrets/metrics-token). Prometheus reads a copy (`authorization:
    # credentials_file`).
    metrics_token_file: str = ""
    # Worker processes serving `port` together (each binds it with SO_REUSEPORT and the kernel
    # spreads connections over them): one per core the gateway may use. Each is a gateway of
    # its own to the router (routing view, quota book), so tenant limits hold across them.
    workers: Annotated[int, msgspec.Meta(ge=1, le=512)] = 1
    # Prefix hints (contracts/prompt_cache.py): memory per model and worker for the prompts'
    # leading parts already rendered, tokenized and hashed (system prompts, earlier turns),
    # so they are never tokenized again; 0 turns the cache off.
    prompt_cache_mb: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 64
    # A chat's new last message of at most this many characters, seen for the first time,
    # is not tokenized for the prefix hints: no engine can hold its blocks unless it was
    # sent before (seen again, a retry or a regenerated answer, it is). The hints then end
    # with the earlier messages' blocks and the prompt's token count is estimated. 0: every
    # message is tokenized (docs/architecture.md, "Prefix hints").
    prompt_defer_chars: Annotated[int, msgspec.Meta(ge=0)] = 1024
    # Each tenant its own prefix cache in the engines: the gateway sets every generation's
    # `cache_salt` from the tenant (contracts/cache_salt.py), so no tenant can tell from its
    # time to first token what another's prompts were. false: tenants share cached prefixes
    # (a system prompt common to all of them computed once), and a client's own cache_salt
    # is passed on as sent.
    isolate_tenant_caches: bool = True
    # Prefix hints only for a model the routing view lists at least this many replicas of:
    # with one there is no choice for them to change (1: always, e.g. to check the hashes).
    prefix_hints_min_replicas: Annotated[int, msgspec.Meta(ge=1)] = 2
    # Prefix hints carry one block hash per this many prompt tokens (whole KV blocks, at
    # least one: every 4th with vLLM's 16-token blocks, every one with 128) and the last
    # full block's; the router matches prefixes at that granularity. A 2k-token prompt then
    # sends 32 hashes rather than 128. Keep one value for a site's gateways: a router
    # without KV events matches what it recorded at that stride.
    prefix_hash_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    # The router in the gateway's process (worker 0 with several workers; the others dial
    # its routing socket as they would `hpcserve router`'s): one process, as the Rust routers
    # are, so a decision is a call, not a round trip to another process (docs/benchmarks.md,
    # "The router in the gateway"). `hpcserve router` is then not run; the router's sockets,
    # CURVE keys and metrics port (router.*) are the same. For one gateway host: the
    # router's work (engines' heartbeats, KV events) shares that worker's core.
    embed_router: bool = False


class SlurmConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit_min: PosInt = 60
    # Seconds before the time limit that Slurm sends USR1 to the batch shell: the drain window.
    drain_s: PosInt = 60
    extra_args: list[str] = []
    # The partition batch pools' jobs go to (`pools[].role = "batch"`), instead of
    # `partition`: one the site made preemptible (e.g. PreemptType=preempt/partition_prio with
    # a lower PriorityTier), so interactive jobs take its GPUs. "": the same as the others.
    batch_partition: str = ""
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
    # A pending replica pinned to a node whose cache holds its model (poolmgr/placement.py)
    # is replaced by an unpinned one once it has waited for that node this long (down,
    # drained, or busy with other jobs); the node is then not pinned to for as long again.
    pin_wait_s: NonNegFloat = 60.0
    # An interactive pool's job pending this long makes an elastic batch pool drain one
    # replica above its floor (one at a time): interactive pools win the GPUs where Slurm
    # does not preempt batch jobs for them (slurm.batch_partition), and where it does, Slurm
    # acts first (poolmgr/batch_sizing.py).
    batch_yield_after_s: NonNegFloat = 30.0
    # An autoscaled interactive pool whose job has been pending for GPUs (Slurm's reason
    # Resources or Priority) this long takes a replica from an autoscaled pool of lower
    # `priority` above its floor (it drains: no request fails), one at a time, lowest
    # priority first; elastic batch pools yield before that (batch_yield_after_s).
    take_gpus_after_s: NonNegFloat = 60.0
    # Where the pool manager writes the live engines as Prometheus file_sd targets (their
    # vLLM /metrics), for `file_sd_configs` (deploy/prometheus/prometheus.example.yml);
    # empty: not written.
    scrape_targets_file: str = ""
    # For rehearsals and benchmarks only (bench/autoscale_day.py), never a production site:
    # - local_queue_wait_s: the local launcher keeps each job PENDING (reason Priority) for a
    #   time drawn from an exponential distribution of this mean (s) before it starts it,
    #   standing in for Slurm's queue wait; the draw is seeded by local_queue_seed and the
    #   job's number, so a run repeats. 0: jobs start at once. Local launcher only.
    # - rehearsal_speedup: the autoscaler (poolmgr/autoscale_pools.py) sees a day compressed
    #   in time: its clock reads rehearsal_day_start (epoch s) at the real time
    #   rehearsal_real_start (epoch s) and runs this many times faster than real time, so
    #   its windows, cooldowns, idle time, SLO windows and the forecast's slices and
    #   quarter hours shrink by this factor; measured durations it is given (cold starts,
    #   the router's unserved ages) are stretched by it, and each request counts as this
    #   many in the arrival forecast (a compressed day's traffic at its real rate). 1: off.
    local_queue_wait_s: NonNegFloat = 0.0
    local_queue_seed: int = 0
    rehearsal_speedup: Annotated[float, msgspec.Meta(ge=1)] = 1.0
    rehearsal_real_start: NonNegFloat = 0.0
    rehearsal_day_start: NonNegFloat = 0.0


Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
# How long the gateway holds a request for a pool at zero: at most an hour (the openai
# client's own default timeout is 10 minutes).
WakeBudget = Annotated[float, msgspec.Meta(ge=0, le=3600)]


Weekday = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
WEEKDAYS: tuple[Weekday, ...] = get_args(Weekday)
# "HH:MM", 00:00..24:00 (24:00: the end of the day).
ClockTime = Annotated[str, msgspec.Meta(pattern=r"^(([01][0-9]|2[0-3]):[0-5][0-9]|24:00)$")]


class ScheduleFloor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An admin's floor for a known peak (pools[].autoscale.schedule): from `start` to `end`
    (the pool manager host's local time) on `days` (none: every day), the pool has at least
    `min` replicas.
    The pool manager raises it ahead of `start` by the pool's measured cold start
    (poolmgr/cold_start.py), so the replicas serve at `start`."""

    start: ClockTime
    end: ClockTime
    min: PosInt
    days: list[Weekday] = []


class AutoscaleCapacity(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What one replica of an autoscaled pool sustains, from the capacity planner
    (hpcserve/planner/, poolmgr/autoscale_capacity.py) in place of `target_in_flight`: the
    largest batch of `prompt_tokens` + `output_tokens` requests whose modelled TTFT and TPOT
    stay within the pool's SLO (ttft_p95_s, tpot_p95_s), on the roofline of `model` (a
    planner catalog name or a config.json path) on `gpu`, or on the measured throughput in
    `calibrate` (an `hpcserve plan --calibrate` file). `tp`: 0 takes the pool's
    tensor_parallel. Checked against the planner when the pool manager starts."""

    model: str
    gpu: str
    prompt_tokens: PosInt
    output_tokens: PosInt
    tp: NonNegInt = 0
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    calibrate: str = ""
    max_num_seqs: PosInt = 256  # the engines' --max-num-seqs


class AutoscaleConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An interactive pool sized by its load (poolmgr/autoscale.py), between min and max.

    The pool wants a replica per `target_in_flight` requests in flight (the engines' running
    plus waiting, or the router's in-flight count, whichever is larger), plus `warm_spares`.
    It grows as soon as the engines have queued more than `max_waiting_per_replica`
    requests per replica, the KV cache is fuller than `max_kv_usage` or the load wants more
    replicas, for `scale_up_window_s`; straight to the size the load needs. It shrinks one
    replica at a time, only once the load has fitted one replica fewer at
    `scale_down_utilization` of `target_in_flight` for `scale_down_window_s`, and
    `scale_down_cooldown_s` after any change; the replica drains (no request fails). With
    an arrival forecast, it keeps instead what the load, the rate now and the forecast over
    the next cold start need (with `queueing_margin`), and goes half the surplus at a time
    after half a measured cold start (at most those window and cooldown).
    """

    max: PosInt
    min: NonNegInt = 1
    # The SLO the pool holds (p95 over requests, from the engines' histograms,
    # poolmgr/slo_windows.py): burnt when the p95 is above it over both the short and the
    # long window (each with at least slo_min_requests requests), which scales up; no
    # scale-down while the short window's p95 is above it.
    ttft_p95_s: PosFloat = 0.8
    tpot_p95_s: PosFloat = 0.05
    slo_short_window_s: PosFloat = 60.0
    slo_long_window_s: PosFloat = 600.0
    slo_min_requests: PosInt = 20
    target_in_flight: PosInt = 8
    max_waiting_per_replica: NonNegInt = 2
    max_kv_usage: Fraction = 0.9
    scale_down_utilization: Fraction = 0.5
    scale_up_window_s: NonNegFloat = 10.0
    scale_down_window_s: NonNegFloat = 300.0
    scale_up_cooldown_s: NonNegFloat = 30.0  # after a scale-up, before the next one
    scale_down_cooldown_s: NonNegFloat = 120.0  # after any change, before a scale-down
    warm_spares: NonNegInt = 0  # replicas above what the load needs (N+1: 1)
    # With a modelled capacity (autoscale.capacity): the forecast's and the scale-down's
    # sizing give a load of a requests in flight (requests/s x each one's time in a
    # replica) a + queueing_margin x sqrt(a) slots (square-root staffing: the headroom
    # Poisson arrivals need under the planner's limit; 0: none). target_in_flight, a target
    # below the limit already, gets none. 1.5: docs/benchmarks.md, issue 19's replay.
    queueing_margin: NonNegFloat = 1.5
    # Scale to zero (min = 0): the pool releases its last replica (it drains) once no request
    # has come for `idle_s`; the first request then wakes it. The gateway holds a request
    # for a pool with no replica up to `wake_budget_s` (0: answers 503 at once), then
    # answers 503 with Retry-After; a tenant whose overflow takes the model overflows at once.
    idle_s: PosFloat = 900.0
    wake_budget_s: WakeBudget = 60.0
    # Floors by time of day and weekday for known peaks (ScheduleFloor); the highest that
    # applies wins over `min`.
    schedule: list[ScheduleFloor] = []
    # One replica's capacity from the planner (AutoscaleCapacity); None: target_in_flight.
    # Either way a replica whose engine queues shows what it runs, and the lower one holds.
    capacity: AutoscaleCapacity | None = None


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
    # Multi-LoRA: max_loras > 0 turns LoRA on; it bounds the adapters a replica holds at once
    # (vLLM --max-loras). lora_adapters (registry adapter names) are loaded at start; any
    # other registry adapter of this pool's model is loaded on demand by the router.
    max_loras: NonNegInt = 0
    max_lora_rank: PosInt = 16
    lora_adapters: list[Name] = []
    # vLLM's --scheduling-policy. "priority" serves the gateway's X-Vllm-Priority (batch after
    # interactive, gateway/batch/priority.py); with equal priorities it is first come, first
    # served, so it is the default. "fcfs" ignores priorities.
    scheduling_policy: SchedulingPolicy = "priority"
    # "batch": the pool runs Batch API and batch-tenant work; interactive requests avoid it
    # while an interactive replica of the model exists (router/policies/pool_roles.py).
    role: PoolRole = "interactive"
    # Elastic batch pool (role "batch" only, poolmgr/batch_sizing.py): 0 keeps `replicas`
    # fixed; above it, the pool grows towards max_replicas while Batch API requests wait and
    # the cluster has idle GPUs (a replica per `backlog_per_replica` waiting requests), and
    # shrinks back to `replicas` once nothing has waited for `scale_down_after_s`.
    max_replicas: NonNegInt = 0
    backlog_per_replica: PosInt = 100
    scale_down_after_s: NonNegFloat = 60.0
    # Tool calling (`tools` / `tool_choice`): the vLLM tool-call parser of the model's format,
    # e.g. "hermes" (Qwen, Hermes), "llama3_json" (Llama 3.1+), "mistral"; the engine gets
    # --enable-auto-tool-choice --tool-call-parser NAME. "": off (vLLM answers 400 to a
    # tool_choice other than "none"). Checked against vLLM 0.32.0's parsers at start.
    tool_call_parser: str = ""
    # Anthropic's Messages API (/v1/messages, gateway/messages.py) for this pool's model: the
    # gateway translates it to chat completions, so any model that serves chat can take it;
    # false refuses it (a base model without a chat template, an embedding model).
    messages_api: bool = True
    # An interactive pool sized by its load between autoscale.min and autoscale.max
    # (poolmgr/autoscale.py); `replicas` is then the size it starts at. None: fixed size.
    autoscale: AutoscaleConfig | None = None
    # Who gets GPUs when the partition is full (poolmgr/gpu_take.py): an autoscaled pool
    # waiting for GPUs takes a replica from an autoscaled pool of lower priority above its
    # floor; equal priorities never take from each other. Batch pools always yield first.
    priority: int = 0
    # This pool's engine.launch_prefix / engine.modules (e.g. another image); None: those.
    launch_prefix: list[LaunchWord] | None = None
    modules: list[ModuleName] | None = None
    # Disaggregated prefill and decode (role "prefill" / "decode", docs/disaggregation.md):
    # the directory, on a filesystem both pools' nodes share, where the CPU build's
    # KV-transfer connector (vLLM's ExampleConnector) stores the prompts' KV cache. Required
    # for a vllm-cpu prefill or decode pool, the same for both; GPU pools use NIXL instead.
    kv_transfer_dir: str = ""
    # The connector never deletes what it stores there, so the pool's engines do
    # (engine_launch/kv_janitor.py): an entry goes this long after the prefill wrote it (long
    # past the prefill -> decode handoff: a decode that finds it gone computes the prompt
    # itself), and the oldest go while the directory holds more than kv_transfer_max_mb. The
    # same for both pools of the pair.
    kv_transfer_ttl_s: Annotated[float, msgspec.Meta(ge=60, le=7 * 86400)] = KV_TRANSFER_TTL_S
    kv_transfer_max_mb: Annotated[int, msgspec.Meta(ge=1)] = KV_TRANSFER_MAX_MB

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
    # The engine token every caller of an engine presents (contracts/engine_token.py); made
    # at the first start if absent. Default: <state_dir>/secrets/engine-token.
    token_file: str = ""
    # How a job starts `hpcserve engine` on its node (docs/deploy.md): this argv goes before
    # it, e.g. ["apptainer", "exec", "--nv", "--bind", "/srv/hpcserve", "/images/hs.sif"]
    # or Pyxis's ["srun", "--container-image=...", "--container-mounts=..."]; empty: run it
    # as is (a venv on the shared filesystem). A pool's own launch_prefix wins.
    launch_prefix: list[LaunchWord] = []
    # Environment modules the job script loads first (`module load ...`), e.g. ["cuda/12.4"].
    modules: list[ModuleName] = []
    # The `hpcserve` the job runs; default: the pool manager's own (a shared-filesystem
    # venv); "hpcserve" (on PATH) inside a container image.
    hpcserve_bin: str = ""
    # vLLM in a network namespace of its own, so no other user of the node reaches its
    # workers' unauthenticated torch.distributed listeners (docs/security.md): "auto" where
    # the kernel allows it (else one warning line), "required" (an engine refuses to start
    # without it), "off". Replicas across nodes and NIXL pools run in the node's namespace.
    private_network: Literal["auto", "required", "off"] = "auto"


Price = Annotated[float, msgspec.Meta(ge=0, le=1e9)]


class CostConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What `hpcserve report` prices GPU-hours and tokens at (hpcserve/report/)."""

    # What one GPU-hour costs the site (hardware written off, power, cooling, staff), in
    # `currency`; 0: not set (the report then shows GPU-hours and tokens, and no cost).
    gpu_hour_price: Price = 0.0
    # Per Slurm partition, where its GPUs cost otherwise: {"a100" = 2.1, "h100" = 4.0}.
    partition_gpu_hour_price: dict[Name, Price] = {}
    currency: Annotated[str, msgspec.Meta(pattern=r"^[A-Z]{3}$")] = "USD"
    # The API price per million input / output tokens that self-hosting is compared with
    # (break-even, savings); 0: none. Their ratio also splits a pool's cost between input
    # and output tokens (without them a token is a token).
    api_price_per_m_input: Price = 0.0
    api_price_per_m_output: Price = 0.0


class BatchConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The Batch API (/v1/files, /v1/batches): where its state lives and how hard it runs."""

    # SQLite database and files directory; default: <state_dir>/batch.
    dir: str = ""
    max_file_bytes: PosInt = 200 * 1024 * 1024
    max_lines: PosInt = 50_000
    # Batch requests in flight per replica of a model (all batches together): enough to keep
    # an engine's batch full, few enough that interactive requests still find room.
    concurrency_per_replica: PosInt = 32
    # Adapt that bound to the engines' reported queues (gateway/batch/concurrency.py: grow
    # while they queue nothing, back off when they queue), from concurrency_per_replica up
    # to max_concurrency_per_replica. Off (the default): concurrency_per_replica is fixed.
    # On suits batch-only pools: measured, it raises batch throughput and, on replicas that
    # also serve interactive traffic, that traffic's TTFT p90 many times (docs/benchmarks.md).
    adaptive_concurrency: bool = False
    max_concurrency_per_replica: PosInt = 1024
    # Tries per request when a replica fails (unreachable, timeout, 5xx) before the error file.
    max_attempts: PosInt = 3
    retry_backoff_s: PosFloat = 1.0
    # What completion_window "24h" means here; shorter only to test expiry.
    completion_window_s: PosFloat = 86_400.0
    # Who runs batches (gateway/batch/lock.py): "standby" (a gateway runs them only while no
    # `hpcserve batch-runner` process is up, and hands them to one that starts), "process"
    # (only `hpcserve batch-runner` does; gateways serve the API and report batches waiting
    # with no runner), "gateway" (a gateway runs them even beside a runner process).
    runner: BatchRunnerMode = "standby"
    # `hpcserve batch-runner`'s Prometheus /metrics (0: off).
    metrics_port: Port = 9103


HealthAction = Literal["log", "stop_routing", "drain", "drain_reset"]
GpuChecks = Literal["auto", "nvml", "off"]


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Health checks (hpcserve.health): the monitor beside each engine, `hpcserve health
    check` (by hand or as Slurm's HealthCheckProgram) and the pool manager's node actions."""

    # The in-job monitor beside each engine: GPU checks, Xid events, generation probe.
    monitor: bool = True
    # NVML: "auto" on engine 'vllm' (GPUs) or when fake_nvml is set; "nvml" always; "off".
    gpu_checks: GpuChecks = "auto"
    # The fake NVML's state file (tests, GPU-less demos; "{node}" becomes the node name).
    # Empty: the real NVML. $HPCSERVE_FAKE_NVML, when set, wins.
    fake_nvml: str = ""
    probe_interval_s: PosFloat = 10.0
    # A one-token greedy generation that takes longer than this is a finding.
    probe_deadline_s: PosFloat = 30.0
    # While requests run, the engine's token counters must move within this many seconds.
    stall_s: PosFloat = 30.0
    # An engine out of routing this long for an engine finding is stopped (the job fails).
    give_up_s: PosFloat = 300.0
    max_temperature_c: PosInt = 90
    # Actions per Xid ("79" = "drain_reset"), over the built-in table (contracts/health_policy.py).
    xid_actions: dict[str, HealthAction] = {}
    # Xids in neither table.
    xid_default: HealthAction = "log"
    # Actions per check name, over the defaults (contracts/health_policy.py).
    actions: dict[str, HealthAction] = {}
    # Site hook for "drain_reset": argv; "{node}" and "{reason}" are filled in.
    reset_hook: list[str] = []
    reset_hook_timeout_s: PosFloat = 60.0
    # `health check --drain` resumes a node hpcserve drained after this many clean checks in
    # a row (0: never). Nodes drained by anyone else are never resumed.
    auto_resume_after: NonNegInt = 0
    # Where `health check` keeps its count of clean checks (node-local).
    check_state_dir: str = "/var/lib/hpcserve/health"
    # Numerical canaries (health/canary.py): a replica of a version with a golden record is
    # compared with it before it registers and then this often (0: only before it registers).
    canary_interval_s: NonNegFloat = 300.0
    # The canary prompts of one check must all be answered within this.
    canary_deadline_s: PosFloat = 60.0


Share = Annotated[float, msgspec.Meta(ge=0, le=1)]


class RolloutConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Staged rollouts (`hpcserve rollout`, poolmgr/rollout.py): how the pool manager's
    rollout loop watches a new version against the stable one of its alias.

    Each check compares the two versions' answers to requests for the alias since the step
    began, summed over `gateways` (their /metrics, gateway/quality.py). A bound is judged
    once the new version has `min_answers` answers in the step (`min_structured` JSON ones
    for JSON validity); the stable version's rate counts only with as many, else it is taken
    as 0 (errors, truncations) or 100% (JSON validity): a thin baseline is strict. A step
    advances once held `--every` and judged on at least `min_answers` answers.
    """

    # How often the loop reads the gateways' metrics and decides.
    check_s: PosFloat = 5.0
    # Gateways whose /metrics are read (base URLs, e.g. http://gw1:8000); empty: this
    # config's gateway (gateway.host and gateway.port; https with gateway.tls_cert).
    gateways: list[str] = []
    metrics_timeout_s: PosFloat = 5.0
    min_answers: PosInt = 50
    min_structured: PosInt = 20
    # Bounds of the new version against the stable one, in points of rate (0.01 = 1 point).
    max_error_rate_increase: Share = 0.01
    max_truncation_rate_increase: Share = 0.05
    max_json_validity_drop: Share = 0.02
    # TTFT p95 (streamed answers): at most stable p95 x ratio + slack.
    ttft_p95_ratio: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    ttft_p95_slack_s: NonNegFloat = 0.1
    # `hpcserve rollout start` without --steps / --every.
    steps: list[int] = msgspec.field(default_factory=lambda: [1, 5, 25, 50, 100])
    every_s: PosFloat = 600.0


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
    health: HealthConfig = HealthConfig()
    batch: BatchConfig = BatchConfig()
    rollout: RolloutConfig = RolloutConfig()
    cost: CostConfig = CostConfig()

    def registry_path(self) -> str:
        return self.registry or str(Path(self.state_dir) / "registry.sqlite3")

    def engine_token_path(self) -> str:
        return self.engine.token_file or str(Path(self.state_dir) / "secrets" / "engine-token")

    def metrics_token_path(self) -> str:
        return self.gateway.metrics_token_file or str(
            Path(self.state_dir) / "secrets" / "metrics-token"
        )

    def batch_dir(self) -> str:
        return self.batch.dir or str(Path(self.state_dir) / "batch")

    def responses_dir(self) -> str:
        return self.gateway.responses_dir or str(Path(self.state_dir) / "responses")

    def usage_dir(self) -> str:
        return self.gateway.usage_dir or str(Path(self.state_dir) / "usage")

    def pool_launch_prefix(self, pool: PoolConfig) -> list[str]:
        """The argv a pool's job puts before `hpcserve engine` (the pool's, else engine's)."""
        return self.engine.launch_prefix if pool.launch_prefix is None else pool.launch_prefix

    def pool_modules(self, pool: PoolConfig) -> list[str]:
        return self.engine.modules if pool.modules is None else pool.modules

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        allowed = ", ".join(p.name for p in self.pools) or "none configured"
        raise ConfigError(f"unknown pool {name!r}; pools: {allowed}")


_PATH_RE = re.compile(r"`\$\.?(?P<path>[^`]*)`")
_STEP_RE = re.compile(r"\.?([^.\[]+)|\[(\d+)\]")
_MISSING = object()
_CHOICES = {
    "engine": get_args(EngineKind),
    "launcher": get_args(Launcher),
    "runner": get_args(BatchRunnerMode),
}


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


def _check_lora(i: int, pool: PoolConfig, cache_dir: str) -> None:
    if pool.lora_adapters and len(pool.lora_adapters) > pool.max_loras:
        raise ConfigError(
            f"pools[{i}].max_loras: {pool.max_loras} is fewer than the {len(pool.lora_adapters)} "
            "lora_adapters loaded at start"
        )
    if pool.max_loras and not cache_dir:
        raise ConfigError(
            f"pools[{i}].max_loras: LoRA needs engine.cache_dir, the node-local directory "
            "adapters are staged into"
        )
    if pool.max_loras and pool.engine == "sim":
        raise ConfigError(f"pools[{i}].max_loras: the simulated engine has no LoRA")
    if pool.max_loras and pool.nodes_per_replica > 1:
        raise ConfigError(
            f"pools[{i}].max_loras: LoRA is not supported for replicas across nodes "
            f"(nodes_per_replica = {pool.nodes_per_replica})"
        )


def _check_tool_calling(i: int, pool: PoolConfig) -> None:
    from hpcserve.contracts.engine_args import TOOL_CALL_PARSERS

    parser = pool.tool_call_parser
    if not parser:
        return
    if any(a.startswith("--tool-call-parser") for a in pool.engine_args):
        raise ConfigError(
            f"pools[{i}].tool_call_parser: {parser!r} and a --tool-call-parser in "
            "engine_args; set one of them"
        )
    # A parser registered by a plugin (--tool-parser-plugin) is vLLM's to check.
    plugin = any(a.startswith("--tool-parser-plugin") for a in pool.engine_args)
    if parser not in TOOL_CALL_PARSERS and not plugin:
        raise ConfigError(
            f"pools[{i}].tool_call_parser: {parser!r} is not a tool-call parser of vLLM "
            f"0.32.0; allowed: {', '.join(sorted(TOOL_CALL_PARSERS))} (or a plugin's, with "
            "--tool-parser-plugin FILE in engine_args)"
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
        _check_lora(i, pool, cfg.engine.cache_dir)
        _check_tool_calling(i, pool)
        _check_elastic(i, pool)
        _check_autoscale(i, pool)
        if pool.nodes_per_replica > 1 and cfg.poolmgr.launcher == "local":
            raise ConfigError(
                f"pools[{i}].nodes_per_replica: {pool.nodes_per_replica} needs "
                "poolmgr.launcher = 'slurm' (the local launcher runs a replica as one local "
                "process)"
            )
        _check_launch_prefix(
            f"pools[{i}].launch_prefix"
            if pool.launch_prefix is not None
            else "engine.launch_prefix",
            cfg.pool_launch_prefix(pool),
            multinode=pool.nodes_per_replica > 1,
            launcher=cfg.poolmgr.launcher,
        )
    _check_launch_prefix(
        "engine.launch_prefix", cfg.engine.launch_prefix, multinode=False, launcher="slurm"
    )
    _check_tenants(cfg.gateway)
    _check_tls(cfg.gateway)
    _check_health(cfg.health)
    if problem := rollout_steps_problem(cfg.rollout.steps):
        raise ConfigError(f"rollout.steps: {problem}, got {cfg.rollout.steps}")
    _check_rehearsal(cfg.poolmgr)
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
    served = [(p.model, p.role) for p in cfg.pools]
    for model, role in served:
        if served.count((model, role)) > 1:
            raise ConfigError(
                f"pools: model {model!r} is served by two pools of role {role!r}; give each its "
                "own (a model may have one interactive and one batch pool)"
            )
    _check_disaggregation(cfg.pools)


def _check_rehearsal(poolmgr: PoolMgrConfig) -> None:
    """The rehearsal knobs (a local queue wait, a compressed day) hang together."""
    if poolmgr.local_queue_wait_s and poolmgr.launcher != "local":
        raise ConfigError(
            f"poolmgr.local_queue_wait_s: {poolmgr.local_queue_wait_s:g} needs "
            "poolmgr.launcher = 'local' (Slurm has a queue wait of its own)"
        )
    if poolmgr.rehearsal_speedup > 1:
        for key in ("rehearsal_real_start", "rehearsal_day_start"):
            if not getattr(poolmgr, key):
                raise ConfigError(
                    f"poolmgr.{key}: poolmgr.rehearsal_speedup is "
                    f"{poolmgr.rehearsal_speedup:g}, so the compressed clock needs its start "
                    "(epoch seconds)"
                )


def _check_disaggregation(pools: list[PoolConfig]) -> None:
    """Prefill and decode pools come in pairs per model, on one engine kind; the CPU
    build's connector needs the shared directory both use (kv_transfer_dir)."""
    for i, pool in enumerate(pools):
        if pool.role not in ("prefill", "decode"):
            defaults = {
                "kv_transfer_dir": "",
                "kv_transfer_ttl_s": KV_TRANSFER_TTL_S,
                "kv_transfer_max_mb": KV_TRANSFER_MAX_MB,
            }
            for key, default in defaults.items():
                if getattr(pool, key) != default:
                    raise ConfigError(
                        f"pools[{i}].{key}: only a prefill or decode pool transfers KV; "
                        f"pool {pool.name!r} has role {pool.role!r}"
                    )
            continue
        other = "decode" if pool.role == "prefill" else "prefill"
        peers = [p for p in pools if p.model == pool.model and p.role == other]
        if not peers:
            raise ConfigError(
                f"pools[{i}].role: pool {pool.name!r} is a {pool.role} pool of model "
                f"{pool.model!r}, which has no {other} pool; disaggregated serving needs both"
            )
        peer = peers[0]
        if peer.engine != pool.engine:
            raise ConfigError(
                f"pools[{i}].engine: {pool.role} pool {pool.name!r} runs {pool.engine!r} but its "
                f"{other} pool {peer.name!r} runs {peer.engine!r}; KV moves only between the same "
                "engine kind"
            )
        if pool.engine == "vllm-cpu" and not pool.kv_transfer_dir:
            raise ConfigError(
                f"pools[{i}].kv_transfer_dir: a vllm-cpu {pool.role} pool ({pool.name!r}) needs "
                "a directory both pools' nodes share, where its connector stores the KV cache"
            )
        if pool.kv_transfer_dir != peer.kv_transfer_dir:
            raise ConfigError(
                f"pools[{i}].kv_transfer_dir: {pool.kv_transfer_dir!r} differs from its {other} "
                f"pool {peer.name!r}'s ({peer.kv_transfer_dir!r}); both must use one directory"
            )
        for key in ("kv_transfer_ttl_s", "kv_transfer_max_mb"):
            if getattr(pool, key) != getattr(peer, key):
                raise ConfigError(
                    f"pools[{i}].{key}: {getattr(pool, key)} differs from its {other} pool "
                    f"{peer.name!r}'s ({getattr(peer, key)}); both sweep one directory"
                )


def rollout_steps_problem(steps: list[int]) -> str:
    """What is wrong with a rollout's canary shares ("" if nothing): percents from 1 to
    100, rising, the last one 100 (the alias then points at the new version)."""
    if not steps:
        return "give at least one step"
    if any(isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 100 for s in steps):
        return "each step is a percent from 1 to 100"
    if any(a >= b for a, b in itertools.pairwise(steps)):
        return "steps must rise"
    if steps[-1] != 100:
        return "the last step must be 100"
    return ""


# `NAME=value` words whose name says secret: a job's script is readable through Slurm
# (`scontrol write batch_script`) and its argv by anyone on the node.
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)^(?:--env=)?[A-Z0-9_]*(TOKEN|SECRET|PASSW|API_?KEY)[A-Z0-9_]*="
)


def _check_launch_prefix(key: str, prefix: list[str], *, multinode: bool, launcher: str) -> None:
    if not prefix:
        return
    if prefix[0].startswith("-"):
        raise ConfigError(f"{key}[0]: {prefix[0]!r} is an option; the prefix starts with a command")
    for j, word in enumerate(prefix):
        if _SECRET_ASSIGNMENT.match(word):
            name = word.removeprefix("--env=").split("=", 1)[0]
            raise ConfigError(
                f"{key}[{j}]: {name}=... looks like a secret; a job's script "
                "and argv are readable by others (scontrol, ps): give the engine a file to read"
            )
    if Path(prefix[0]).name == "srun" and multinode:
        raise ConfigError(
            f"{key}: a prefix starting with srun cannot wrap a multi-node replica, whose job "
            "already starts its ranks with srun; use a per-node prefix (apptainer exec ...)"
        )
    if Path(prefix[0]).name == "srun" and launcher == "local":
        raise ConfigError(f"{key}: srun needs poolmgr.launcher = 'slurm'")


def _check_elastic(i: int, pool: PoolConfig) -> None:
    if not pool.max_replicas:
        return
    if pool.role != "batch":
        raise ConfigError(
            f"pools[{i}].max_replicas: only a batch pool (role = 'batch') grows with its "
            f"backlog; pool {pool.name!r} has role {pool.role!r}"
        )
    if pool.max_replicas < pool.replicas:
        raise ConfigError(
            f"pools[{i}].max_replicas: {pool.max_replicas} is below replicas "
            f"({pool.replicas}), the pool's floor"
        )


def _check_autoscale_role(key: str, pool: PoolConfig, auto: AutoscaleConfig) -> None:
    """A prefill or decode pool scales on its own signals (poolmgr/autoscale_roles.py): an
    SLO its engines cannot see is refused, not ignored (an admin would think it held), and
    so is scale to zero (a PD request whose other pool still serves never finds no replica,
    so the pool at zero would never be woken)."""
    default = AutoscaleConfig(max=1)
    other = {"prefill": "decode", "decode": "prefill"}.get(pool.role)
    if other is None:
        return
    if pool.role == "prefill" and auto.tpot_p95_s != default.tpot_p95_s:
        raise ConfigError(
            f"{key}.tpot_p95_s: pool {pool.name!r} is a prefill pool: it answers one token per "
            "request, so its engines report no TPOT; set the TPOT SLO on the model's decode pool"
        )
    if pool.role == "decode" and auto.ttft_p95_s != default.ttft_p95_s:
        raise ConfigError(
            f"{key}.ttft_p95_s: pool {pool.name!r} is a decode pool: the prompt's wait, which "
            "more replicas shorten, is the prefill pool's; set the TTFT SLO on the model's "
            "prefill pool"
        )
    if auto.min == 0:
        raise ConfigError(
            f"{key}.min: 0 on {pool.role} pool {pool.name!r}: while its {other} pool serves, "
            "the model's requests find a replica and none would wake it; keep min >= 1"
        )


def _check_autoscale(i: int, pool: PoolConfig) -> None:
    auto = pool.autoscale
    if auto is None:
        return
    key = f"pools[{i}].autoscale"
    if pool.role == "batch":
        raise ConfigError(
            f"{key}: pool {pool.name!r} has role 'batch', which grows with the Batch API "
            "backlog (max_replicas); autoscale is for interactive, prefill and decode pools"
        )
    _check_autoscale_role(key, pool, auto)
    if auto.min > auto.max:
        raise ConfigError(f"{key}.min: {auto.min} is above autoscale.max ({auto.max})")
    if not auto.min <= pool.replicas <= auto.max:
        raise ConfigError(
            f"pools[{i}].replicas: {pool.replicas} is outside autoscale.min..max "
            f"({auto.min}..{auto.max}); with autoscale it is the size the pool starts at"
        )
    if auto.warm_spares >= auto.max:
        raise ConfigError(
            f"{key}.warm_spares: {auto.warm_spares} leaves no room below autoscale.max "
            f"({auto.max}) for the load itself"
        )
    if auto.slo_short_window_s >= auto.slo_long_window_s:
        raise ConfigError(
            f"{key}.slo_short_window_s: {auto.slo_short_window_s:g} is not below "
            f"slo_long_window_s ({auto.slo_long_window_s:g})"
        )
    for j, floor in enumerate(auto.schedule):
        at = f"{key}.schedule[{j}]"
        if floor.min > auto.max:
            raise ConfigError(f"{at}.min: {floor.min} is above autoscale.max ({auto.max})")
        if floor.end <= floor.start:
            raise ConfigError(
                f"{at}.end: {floor.end} is not after start ({floor.start}); a floor through "
                "midnight is two entries (start..24:00 and 00:00..end of the next day)"
            )


def _check_health(health: HealthConfig) -> None:
    from hpcserve.contracts.health_policy import CHECKS

    for key in health.xid_actions:
        if not key.isdigit():
            raise ConfigError(f"health.xid_actions: key {key!r} is not an Xid number")
    for key in health.actions:
        if key not in CHECKS:
            raise ConfigError(
                f"health.actions: unknown check {key!r}; checks: {', '.join(sorted(CHECKS))}"
            )
    uses_reset = "drain_reset" in (
        *health.xid_actions.values(),
        *health.actions.values(),
        health.xid_default,
    )
    if uses_reset and not health.reset_hook:
        raise ConfigError(
            "health.reset_hook: an action is 'drain_reset' but no reset hook is configured"
        )


def _check_tls(gateway: GatewayConfig) -> None:
    if bool(gateway.tls_cert) != bool(gateway.tls_key):
        given, missing = ("tls_cert", "tls_key") if gateway.tls_cert else ("tls_key", "tls_cert")
        raise ConfigError(f"gateway.{missing}: gateway.{given} is set; TLS needs both files")


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
        if tenant.queue_budget_s and tenant.overflow != "external":
            raise ConfigError(
                f"gateway.tenants[{i}].queue_budget_s: {tenant.name!r} never overflows "
                f"(overflow {tenant.overflow!r}), so a queue budget means nothing; remove it"
            )
    if declared:
        for i, key in enumerate(gateway.api_keys):
            if key.tenant not in declared:
                raise ConfigError(
                    f"gateway.api_keys[{i}].tenant: {key.tenant!r} is not one of "
                    f"gateway.tenants ({', '.join(sorted(declared))})"
                )
    overflowing = [t.name for t in gateway.tenants if t.overflow == "external"]
    if overflowing and not gateway.overflow.base_url:
        raise ConfigError(
            f"gateway.overflow.base_url: tenants {', '.join(overflowing)} have overflow = "
            "'external' but no external API is configured"
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
    return with_default_curve_dir(cfg)


def with_default_curve_dir(cfg: PlatformConfig) -> PlatformConfig:
    """`cfg` with router.curve_dir = <state_dir>/curve when it names none and plain was not
    asked for: every component then reads the same keys from router.curve_dir."""
    if cfg.router.curve_dir or cfg.router.plain():
        return cfg
    router = msgspec.structs.replace(cfg.router, curve_dir=str(Path(cfg.state_dir) / "curve"))
    return msgspec.structs.replace(cfg, router=router)


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
        items = [(k, v) for k, v in value.items() if v is not None]  # None: the default, unset
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in items) + "}"
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
        elif value is not None:  # TOML has no null: a None is the key's default, left out
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
                lines.extend(
                    f"{_toml_key(ik)} = {_toml_value(iv)}"
                    for ik, iv in item.items()
                    if iv is not None
                )
    for key, items in arrays:
        for item in items:
            lines.append(f"\n[[{key}]]")
            lines.extend(
                f"{_toml_key(ik)} = {_toml_value(iv)}" for ik, iv in item.items() if iv is not None
            )
    return "\n".join(lines) + "\n"


DEFAULT_STATE_DIR = ".state"


def config_path(arg: str | None) -> Path:
    """The config file a command reads: --config, else $HPCSERVE_CONFIG, else .state's."""
    if arg:
        return Path(arg)
    if os.environ.get("HPCSERVE_CONFIG"):
        return Path(os.environ["HPCSERVE_CONFIG"])
    return Path(DEFAULT_STATE_DIR) / "hpcserve.toml"
