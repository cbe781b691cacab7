"""A blocking one-shot query to the router, for CLI commands (`hpcserve status`, `up`), the
pool manager and `hpcserve health check`: a libzmq DEALER on the routing socket, a CURVE
client with the gateway key when `curve_dir` is given (contracts/zmtp_curve.py)."""

from __future__ import annotations

import itertools

import zmq
from zmq.utils import z85

from hpcserve.contracts import protocol as p
from hpcserve.contracts.zmtp_curve import routing_client_keys

_ids = itertools.count(1)


class RouterQueryError(RuntimeError):
    pass


def list_replicas(
    endpoint: str, timeout_s: float = 2.0, *, curve_dir: str = ""
) -> list[p.ReplicaInfo]:
    return replica_list(endpoint, timeout_s, curve_dir=curve_dir).replicas


def replica_list(
    endpoint: str,
    timeout_s: float = 2.0,
    *,
    curve_dir: str = "",
    node_switches: dict[str, str] | None = None,
) -> p.ReplicaList:
    """The router's whole answer: the replicas, and its unserved demand per model.
    node_switches: the switch topology for the router (the pool manager's; None: none)."""
    request = p.ListReplicas(next(_ids), node_switches=node_switches)
    reply = _ask(endpoint, request, timeout_s, curve_dir)
    assert isinstance(reply, p.ReplicaList)
    return reply


def list_models(endpoint: str, timeout_s: float = 2.0, *, curve_dir: str = "") -> list[p.ModelInfo]:
    reply = _ask(endpoint, p.ListModels(next(_ids)), timeout_s, curve_dir)
    assert isinstance(reply, p.ModelList)
    return reply.models


def _ask(
    endpoint: str, message: p.RoutingMessage, timeout_s: float, curve_dir: str = ""
) -> p.RoutingReply:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A router that refuses us (no key, a wrong one) leaves no connection to queue on, and a
    # send would wait for one forever.
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        keys = routing_client_keys(curve_dir)
        if keys is not None:
            sock.curve_publickey = z85.encode(keys.public)
            sock.curve_secretkey = z85.encode(keys.secret)
            sock.curve_serverkey = z85.encode(keys.server_public)
        sock.connect(endpoint)
        try:
            sock.send(p.encode(message))
        except zmq.Again:
            raise RouterQueryError(
                f"router at {endpoint} took no message within {timeout_s:g}s (not running, or "
                "it refused this client's key: router.curve_dir)"
            ) from None
        if not sock.poll(int(timeout_s * 1000)):
            raise RouterQueryError(f"router at {endpoint} did not answer within {timeout_s:g}s")
        return p.routing_reply_decoder.decode(sock.recv())
    finally:
        sock.close(0)


def list_health_events(
    endpoint: str,
    epoch: str = "",
    ack_seq: int = 0,
    timeout_s: float = 2.0,
    *,
    curve_dir: str = "",
) -> p.HealthEvents:
    """Health events the router holds; those up to ack_seq of epoch are acknowledged."""
    reply = _ask(endpoint, p.ListHealthEvents(next(_ids), epoch, ack_seq), timeout_s, curve_dir)
    assert isinstance(reply, p.HealthEvents)
    return reply
