"""The wire protocol between engines, the router and gateways: every message in one place.

Rules (see docs/architecture.md): each message is a tagged, frozen msgspec Struct;
a tag is never reused; new fields get defaults and go last, so an older peer can
still decode a newer message.

Two conversations, each on its own router socket:

- registry (engine agent DEALER -> router ROUTER): Register, Heartbeat, Deregister;
  the router answers each with RegistryAck (or ReRegister when it does not know the
  replica, e.g. after a router restart). The router may also send LoadAdapter (load a
  LoRA adapter on demand), which the agent answers with AdapterLoaded.
- routing (gateway DEALER -> router ROUTER): Route -> RouteReply,
  Release and InFlight (fire and forget), ListModels -> ModelList, ListReplicas ->
  ReplicaList.
"""

from __future__ import annotations

import msgspec


class LatencyHistogram(msgspec.Struct, frozen=True, array_like=True):
    """A Prometheus histogram as an engine exports it, cumulative since it started: the
    count of observations <= each finite bound (`le`, ascending), of all of them, and their
    sum (`_sum`; 0.0: not reported)."""

    bounds: list[float] = []
    counts: list[int] = []
    total: int = 0
    sum: float = 0.0


class ReplicaLoad(msgspec.Struct, frozen=True):
    """What an engine reports about its load on each heartbeat."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    # The KV cache's size in tokens (vLLM's num_gpu_blocks x block_size; 0: unknown), so
    # the router places new contexts by the room each replica has (policies/scorers.py).
    kv_capacity_tokens: int = 0
    # vLLM's TTFT and per-request TPOT histograms (vllm:time_to_first_token_seconds,
    # vllm:request_time_per_output_token_seconds); None: not reported. The pool manager's
    # autoscaler reads their p95 over a short and a long window (poolmgr/slo_windows.py).
    ttft: LatencyHistogram | None = None
    tpot: LatencyHistogram | None = None


class Register(msgspec.Struct, frozen=True, tag="register"):
    replica_id: str
    model: str
    url: str
    pool: str = ""
    slurm_job_id: int = 0
    node: str = ""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    max_model_len: int = 0
    load: ReplicaLoad = ReplicaLoad()
    # LoRA (router/adapters.py): the adapters loaded now, how many may be loaded at once
    # (0: LoRA off), and the registry model they must be trained for.
    adapters: list[str] = []
    max_adapters: int = 0
    base_model: str = ""
    # KV-cache awareness (router/kv_subscriber.py): vLLM's KV-event PUB and replay endpoints
    # (empty: no events; the router then remembers what it routed where) and its block size.
    block_size: int = 0
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    kv_events_topic: str = ""
    # The node cache's entries (cache keys) when registering: the pool manager places new
    # replicas on nodes that hold their model (poolmgr/placement.py).
    cached: list[str] = []
    # The registry version it serves (name@version; empty for a model_path pool): the pool
    # manager records it in the registry, so a version in use cannot be removed.
    model_ref: str = ""
    # Its pool's role (pools[].role): "interactive" or "batch" (router/policies/pool_roles.py),
    # "prefill" or "decode" (router/policies/pd_roles.py).
    role: str = "interactive"
    # Its KV-cache events come relayed by its engine agent over the router's KV relay socket
    # (engine_launch/kv_relay.py), on topic kv_events_topic; the endpoints above stay empty.
    kv_events_relayed: bool = False
    # Disaggregated prefill and decode (role "prefill" or "decode"): the KV-transfer
    # connector its engine runs (contracts/engine_args.py kv_connector; "": none).
    kv_connector: str = ""


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    replica_id: str
    load: ReplicaLoad = ReplicaLoad()
    # The LoRA adapters loaded now; None: unchanged (or LoRA off).
    adapters: list[str] | None = None


class Deregister(msgspec.Struct, frozen=True, tag="deregister"):
    replica_id: str
    reason: str = ""


class RegistryAck(msgspec.Struct, frozen=True, tag="ack"):
    replica_id: str
    lease_s: float
    # Where the engine's agent relays its KV-cache events (engine_launch/kv_relay.py); empty
    # when the router takes none.
    kv_relay: str = ""


class ReRegister(msgspec.Struct, frozen=True, tag="reregister"):
    """The router does not know this replica (it restarted, or the lease lapsed)."""

    replica_id: str


class LoadAdapter(msgspec.Struct, frozen=True, tag="load_adapter"):
    """Router -> engine agent: unload `unload`, stage the LoRA adapter from `source` into
    the node cache (verified against `manifest`, its digest manifest as JSON) and load it
    into vLLM. Answered by AdapterLoaded."""

    replica_id: str
    adapter: str
    source: str
    manifest: bytes
    unload: list[str] = []


class AdapterLoaded(msgspec.Struct, frozen=True, tag="adapter_loaded"):
    """Engine agent -> router: the outcome of a LoadAdapter (error empty: loaded)."""

    replica_id: str
    adapter: str
    error: str = ""
    adapters: list[str] = []  # loaded now


class Route(msgspec.Struct, frozen=True, tag="route"):
    request_id: int
    model: str
    # Prefix-aware routing (contracts/prefix_hash.py): the chained hashes of the prompt's full
    # blocks of `block_size` tokens (empty: unknown), the prompt's token count, the LoRA
    # adapter asked for, "interactive" or "batch", and a session key for affinity.
    block_hashes: list[int] = []
    block_size: int = 0
    prompt_tokens: int = 0
    adapter: str = ""
    priority: str = "interactive"
    session_key: str = ""
    # Failover (gateway): replicas that already failed this request; never picked again.
    exclude: list[str] = []
    # Releases folded into this Route (one send instead of two; see Release).
    released: list[str] = []
    # Overflow (router/queue_wait.py): > 0 when the gateway may send the request elsewhere;
    # the router then answers error "over_queue_budget" rather than queue it longer.
    queue_budget_s: float = 0.0
    # Keeps a user on one version of a canary alias (after session_key): the request's
    # OpenAI `user`, or its x-session-id when the gateway sends no session_key.
    user: str = ""
    # The `model` each of `released` asked for, in the same order ("": not said); the
    # router counts requests in flight per LoRA adapter (router/adapters.py).
    released_models: list[str] = []
    # Sampled prefix hashes (gateway.prefix_hash_tokens): with hash_stride k > 1,
    # block_hashes holds the chained hash of every k-th full block (the k-th, 2k-th, ...)
    # and, when the prompt's `hashed_blocks` full blocks are not a multiple of k, the last
    # one's. The router then matches at that granularity: n leading hashes held mean
    # min(n x k, hashed_blocks) blocks. 0: len(block_hashes) x hash_stride.
    hash_stride: int = 1
    hashed_blocks: int = 0


# RouteReply.error when no replica's estimated queue wait is within Route.queue_budget_s.
OVER_QUEUE_BUDGET = "over_queue_budget"
# RouteReply.error from a router that started moments ago and has no replica for the model
# yet: the fleet's engines re-register at their next heartbeat, so ask again shortly
# (a gateway does, until the router says no_replica). Older gateways read it as no replica.
ROUTER_STARTING = "router_starting"


class RouteReply(msgspec.Struct, frozen=True, tag="route_reply"):
    request_id: int
    replica_id: str = ""
    url: str = ""
    # Empty replica_id means no replica; error says why ("unknown_model", "no_replica").
    error: str = ""
    # The name the replica serves the request under when the request named an alias
    # (router/aliases.py): the gateway puts it in the body it forwards. Empty: unchanged.
    model: str = ""
    # error "over_queue_budget": the shortest queue wait the router estimated, seconds.
    queue_wait_s: float = 0.0
    # The router's epoch (new at every start, QuotaTotals.epoch): a gateway that sees it
    # change re-declares the requests it has in flight (InFlight).
    epoch: str = ""
    # What the picked replica serves: its registry version (name@version; empty for a
    # model_path pool) and, for a LoRA request, the adapter. The gateway labels its online
    # quality metrics with them (gateway/quality.py), which staged rollouts compare. With no
    # replica: the version an alias or adapter asked for resolves to (ReplicaList.
    # unserved_refs), so the gateway holds it for the pool at zero that serves it.
    model_ref: str = ""
    adapter: str = ""
    # Disaggregated prefill and decode: the prefill replica picked for the request (empty:
    # none, the replica above serves it whole). The gateway sends the prompt there first
    # (max_tokens 1, kv_transfer_params), then the request to the decode replica above with
    # the transfer parameters the prefill returned (gateway/disagg.py); both are released.
    prefill_replica_id: str = ""
    prefill_url: str = ""


class Release(msgspec.Struct, frozen=True, tag="release"):
    """A routed request finished; the router's in-flight count for the replica drops (for a
    request routed or declared on the same connection: router/in_flight_book.py)."""

    replica_id: str
    model: str = ""  # what the request asked for ("": not said)


class ListModels(msgspec.Struct, frozen=True, tag="list_models"):
    request_id: int


class ModelInfo(msgspec.Struct, frozen=True):
    id: str
    replicas: int
    created: int = 0
    parent: str = ""  # a LoRA adapter: the model it runs on
    alias_of: str = ""  # an alias: the registry version it routes to (name@version)


class ModelList(msgspec.Struct, frozen=True, tag="model_list"):
    request_id: int
    models: list[ModelInfo] = []


class ListReplicas(msgspec.Struct, frozen=True, tag="list_replicas"):
    request_id: int
    # The pool manager's word on the switch topology (Slurm's topology/tree): node -> its
    # leaf switch, for the decode replica's locality (router/policies/pd_roles.py); {}: the
    # site has none. None (gateways, CLI commands): says nothing, the router keeps what it
    # has. The pool manager sends it when it changed and once to each router epoch.
    node_switches: dict[str, str] | None = None


class ReplicaInfo(msgspec.Struct, frozen=True):
    replica_id: str
    model: str
    url: str
    pool: str
    slurm_job_id: int
    node: str
    age_s: float
    last_seen_age_s: float
    in_flight: int
    load: ReplicaLoad
    cached: list[str] = []  # its node's cache entries when it registered
    model_ref: str = ""  # the registry version it serves
    role: str = "interactive"  # its pool's role (Register.role)
    # Requests routed to it since it registered (the pool manager's autoscaler tells an idle
    # pool from one whose short requests fall between its polls: poolmgr/autoscale.py).
    routed: int = 0
    # Its node's leaf switch as the router knows it (ListReplicas.node_switches); "": none.
    switch: str = ""


class ReplicaList(msgspec.Struct, frozen=True, tag="replica_list"):
    request_id: int
    replicas: list[ReplicaInfo] = []
    epoch: str = ""  # the router's (RouteReply.epoch)
    # Alias name -> the registry version it routes to (name@version, canary aside): the
    # gateway routes aliases on these while the router is away (gateway/replica_view.py).
    aliases: dict[str, str] = {}
    # Model name -> seconds since the router last answered a Route for it without a replica
    # (within the last hour): demand for a pool scaled to zero, which the pool manager wakes.
    unserved: dict[str, float] = {}
    # The same for the registry version an unserved alias or LoRA adapter resolved to
    # (name@version; an adapter bound to no version: its base model's name). A pool at zero
    # has no replica to tell the router its served name: the pool manager maps these to the
    # pools whose model_ref resolves to them (poolmgr/wake_names.py).
    unserved_refs: dict[str, float] = {}


class InFlight(msgspec.Struct, frozen=True, tag="in_flight"):
    """Requests a gateway has in flight that this router did not route (it restarted since,
    or the gateway routed them while it was away): counted in flight until released.
    One entry per request, as Route.released / released_models."""

    replica_ids: list[str] = []
    models: list[str] = []


class UsageSlot(msgspec.Struct, frozen=True):
    """One second of a gateway's window: how long ago it was, and what it used."""

    age_s: float
    requests: int = 0
    tokens: int = 0


class TenantUsage(msgspec.Struct, frozen=True):
    """One tenant's usage on one gateway since its last report; in_flight is absolute."""

    tenant: str
    requests: int = 0
    tokens: int = 0
    in_flight: int = 0
    # Sent instead of deltas after the router's epoch changed (it restarted): this gateway's
    # whole one-minute window, which replaces what the router's book holds for it.
    window: list[UsageSlot] | None = None


class QuotaReport(msgspec.Struct, frozen=True, tag="quota_report"):
    """A gateway's batched usage deltas (router/quota_book.py); answered by QuotaTotals."""

    request_id: int
    gateway_id: str
    usage: list[TenantUsage] = []


class TenantTotals(msgspec.Struct, frozen=True):
    """The other gateways' usage of one tenant over the last minute."""

    tenant: str
    requests: int = 0
    tokens: int = 0
    in_flight: int = 0
    # Seconds until the oldest of that usage leaves the one-minute window.
    frees_in_s: float = 0.0


class QuotaTotals(msgspec.Struct, frozen=True, tag="quota_totals"):
    request_id: int
    tenants: list[TenantTotals] = []
    # The quota book's epoch, new at every router start: a gateway that sees it change
    # re-sends its whole window (TenantUsage.window), so a restart forgets nothing.
    epoch: str = ""


class HealthFinding(msgspec.Struct, frozen=True):
    """One health check's finding (hpcserve.health): what an admin reads, what to do."""

    check: str  # e.g. "xid", "ecc_uncorrectable", "engine_probe"
    detail: str  # e.g. "xid 79 gpu 3"; a drain reason is "hpcserve: " + detail
    action: str = "log"  # log | stop_routing | drain | drain_reset
    gpu: int = -1


class HealthReport(msgspec.Struct, frozen=True, tag="health_report"):
    """An engine's monitor found something: the router stops routing to the replica when
    an action is stop_routing or worse, and keeps node findings for the pool manager."""

    replica_id: str
    findings: list[HealthFinding] = []
    node: str = ""
    slurm_job_id: int = 0
    pool: str = ""


class CanaryReport(msgspec.Struct, frozen=True, tag="canary_report"):
    """One numerical canary check of a replica (contracts/canary.py), before it registers or
    by its health monitor: the router counts them. A mismatch also comes as a HealthReport
    (check numerical_canary), which is what takes the replica out of routing. No reply."""

    replica_id: str
    model_ref: str = ""
    result: str = "pass"  # pass | mismatch | error
    stage: str = "periodic"  # before_register | periodic
    detail: str = ""


class KvCleanupReport(msgspec.Struct, frozen=True, tag="kv_cleanup_report"):
    """A sweep of the storage connector's directory (pools[].kv_transfer_dir) by a prefill or
    decode replica's janitor (engine_launch/kv_janitor.py) that removed something: entries
    past their TTL, and the oldest beyond the byte cap. The router counts them. No reply."""

    replica_id: str
    expired: int = 0
    expired_bytes: int = 0
    over_cap: int = 0
    over_cap_bytes: int = 0
    left_bytes: int = 0  # what the directory still holds


class HealthEvent(msgspec.Struct, frozen=True):
    seq: int
    at: float  # epoch seconds, the router's clock
    replica_id: str
    node: str
    slurm_job_id: int
    pool: str
    finding: HealthFinding


class ListHealthEvents(msgspec.Struct, frozen=True, tag="list_health_events"):
    """The pool manager asks for health events; those up to `ack_seq` of `epoch` it has
    acted on and the router forgets them."""

    request_id: int
    epoch: str = ""
    ack_seq: int = 0


class HealthEvents(msgspec.Struct, frozen=True, tag="health_events"):
    request_id: int
    epoch: str  # changes when the router restarts (sequence numbers start again)
    events: list[HealthEvent] = []


RegistryMessage = (
    Register
    | Heartbeat
    | Deregister
    | AdapterLoaded
    | HealthReport
    | CanaryReport
    | KvCleanupReport
)
RegistryReply = RegistryAck | ReRegister | LoadAdapter
RoutingMessage = (
    Route | Release | ListModels | ListReplicas | QuotaReport | ListHealthEvents | InFlight
)
RoutingReply = RouteReply | ModelList | ReplicaList | QuotaTotals | HealthEvents

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

registry_message_decoder = msgspec.msgpack.Decoder(RegistryMessage)
registry_reply_decoder = msgspec.msgpack.Decoder(RegistryReply)
routing_message_decoder = msgspec.msgpack.Decoder(RoutingMessage)
routing_reply_decoder = msgspec.msgpack.Decoder(RoutingReply)
