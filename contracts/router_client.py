"""A blocking one-shot query to the router, for CLI commands (`hpcserve status`, `up`)."""

from __future__ import annotations

import itertools

import zmq

from hpcserve.contracts import protocol as p

_ids = itertools.count(1)


class RouterQueryError(RuntimeError):
    pass


def list_replicas(endpoint: str, timeout_s: float = 2.0) -> list[p.ReplicaInfo]:
    reply = _ask(endpoint, p.ListReplicas(next(_ids)), timeout_s)
    assert isinstance(reply, p.ReplicaList)
    return reply.replicas


def list_models(endpoint: str, timeout_s: float = 2.0) -> list[p.ModelInfo]:
    reply = _ask(endpoint, p.ListModels(next(_ids)), timeout_s)
    assert isinstance(reply, p.ModelList)
    return reply.models


def _ask(endpoint: str, message: p.RoutingMessage, timeout_s: float) -> p.RoutingReply:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(p.encode(message))
        if not sock.poll(int(timeout_s * 1000)):
            raise RouterQueryError(f"router at {endpoint} did not answer within {timeout_s:g}s")
        return p.routing_reply_decoder.decode(sock.recv())
    finally:
        sock.close(0)


def list_health_events(
    endpoint: str, epoch: str = "", ack_seq: int = 0, timeout_s: float = 2.0
) -> p.HealthEvents:
    """Health events the router holds; those up to ack_seq of epoch are acknowledged."""
    reply = _ask(endpoint, p.ListHealthEvents(next(_ids), epoch, ack_seq), timeout_s)
    assert isinstance(reply, p.HealthEvents)
    return reply
