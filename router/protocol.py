"""The wire protocol between engines, the router and gateways: every message in one place.

Rules (see docs/architecture.md): each message is a tagged, frozen msgspec Struct;
a tag is never reused; new fields get defaults and go last, so an older peer can
still decode a newer message.

Two conversations, each on its own router socket:

- registry (engine agent DEALER -> router ROUTER): Register, Heartbeat, Deregister;
  the router answers each with RegistryAck (or ReRegister when it does not know the
  replica, e.g. after a router restart).
- routing (gateway DEALER -> router ROUTER): Route -> RouteReply,
  Release (fire and forget), ListModels -> ModelList, ListReplicas -> ReplicaList.
"""

from __future__ import annotations

import msgspec


class ReplicaLoad(msgspec.Struct, frozen=True):
    """What an engine reports about its load on each heartbeat."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


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


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    replica_id: str
    load: ReplicaLoad = ReplicaLoad()


class Deregister(msgspec.Struct, frozen=True, tag="deregister"):
    replica_id: str
    reason: str = ""


class RegistryAck(msgspec.Struct, frozen=True, tag="ack"):
    replica_id: str
    lease_s: float


class ReRegister(msgspec.Struct, frozen=True, tag="reregister"):
    """The router does not know this replica (it restarted, or the lease lapsed)."""

    replica_id: str


class Route(msgspec.Struct, frozen=True, tag="route"):
    request_id: int
    model: str


class RouteReply(msgspec.Struct, frozen=True, tag="route_reply"):
    request_id: int
    replica_id: str = ""
    url: str = ""
    # Empty replica_id means no replica; error says why ("unknown_model", "no_replica").
    error: str = ""


class Release(msgspec.Struct, frozen=True, tag="release"):
    """A routed request finished; the router's in-flight count for the replica drops."""

    replica_id: str


class ListModels(msgspec.Struct, frozen=True, tag="list_models"):
    request_id: int


class ModelInfo(msgspec.Struct, frozen=True):
    id: str
    replicas: int
    created: int = 0


class ModelList(msgspec.Struct, frozen=True, tag="model_list"):
    request_id: int
    models: list[ModelInfo] = []


class ListReplicas(msgspec.Struct, frozen=True, tag="list_replicas"):
    request_id: int


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


class ReplicaList(msgspec.Struct, frozen=True, tag="replica_list"):
    request_id: int
    replicas: list[ReplicaInfo] = []


RegistryMessage = Register | Heartbeat | Deregister
RegistryReply = RegistryAck | ReRegister
RoutingMessage = Route | Release | ListModels | ListReplicas
RoutingReply = RouteReply | ModelList | ReplicaList

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

registry_message_decoder = msgspec.msgpack.Decoder(RegistryMessage)
registry_reply_decoder = msgspec.msgpack.Decoder(RegistryReply)
routing_message_decoder = msgspec.msgpack.Decoder(RoutingMessage)
routing_reply_decoder = msgspec.msgpack.Decoder(RoutingReply)
