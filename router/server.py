"""The router process: the registry socket for engines, the routing socket for gateways.

Both are ZeroMQ ROUTER sockets the router binds (it is the stable side); engines
and gateways connect DEALERs. One thread owns both sockets and polls them with a
timeout, so lease expiry runs even when no message arrives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hpcserve.config import RouterConfig
from hpcserve.router import protocol as p
from hpcserve.router.policy import LeastLoad
from hpcserve.router.registry import Registry

log = logging.getLogger(__name__)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.replicas = Gauge(
            "hpcserve_router_replicas", "Live replicas by model", ["model"], registry=registry
        )
        self.registry_messages = Counter(
            "hpcserve_router_registry_messages_total",
            "Engine messages by type",
            ["type"],
            registry=registry,
        )
        self.routes = Counter(
            "hpcserve_router_routes_total",
            "Routing decisions by outcome",
            ["outcome"],
            registry=registry,
        )
        self.lease_expiries = Counter(
            "hpcserve_router_lease_expiries_total",
            "Replicas dropped for a lapsed lease",
            registry=registry,
        )
        self.bad_messages = Counter(
            "hpcserve_router_bad_messages_total",
            "Undecodable messages by socket",
            ["socket"],
            registry=registry,
        )
        self.decision_seconds = Histogram(
            "hpcserve_router_decision_seconds",
            "Time to pick a replica",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2),
            registry=registry,
        )


class RouterServer:
    def __init__(
        self,
        config: RouterConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context | None = None,
    ) -> None:
        self.config = config
        self.registry = Registry(config.lease_s)
        self.policy = LeastLoad()
        self.metrics = RouterMetrics(metrics_registry or CollectorRegistry())
        self._clock = clock
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._registry_sock: zmq.Socket | None = None
        self._routing_sock: zmq.Socket | None = None
        self.ready = threading.Event()
        self._published_models: set[str] = set()

    def bind(self) -> None:
        self._registry_sock = self._bind(self.config.registry_bind)
        self._routing_sock = self._bind(self.config.routing_bind)
        log.info(
            "router listening: registry %s, routing %s",
            self.config.registry_bind,
            self.config.routing_bind,
        )

    def _bind(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # An unreachable peer must not block the router: drop instead of queueing forever.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as err:
            sock.close()
            raise RuntimeError(f"router cannot bind {endpoint}: {err}") from None
        return sock

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        if self._registry_sock is None:
            self.bind()
        assert self._registry_sock is not None and self._routing_sock is not None
        poller = zmq.Poller()
        poller.register(self._registry_sock, zmq.POLLIN)
        poller.register(self._routing_sock, zmq.POLLIN)
        tick_ms = int(min(self.config.lease_s / 4, 0.5) * 1000)
        self.ready.set()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(tick_ms))
                if self._registry_sock in events:
                    self._drain(self._registry_sock, self._on_registry)
                if self._routing_sock in events:
                    self._drain(self._routing_sock, self._on_routing)
                for _ in self.registry.expire(self._clock()):
                    self.metrics.lease_expiries.inc()
                self._publish_gauges()
        finally:
            self._registry_sock.close(0)
            self._routing_sock.close(0)
            log.info("router stopped")

    def _drain(self, sock: zmq.Socket, handler: Callable[[zmq.Socket, bytes, bytes], None]) -> None:
        # Handle everything queued now, but bounded so one busy socket cannot starve the other.
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.metrics.bad_messages.labels(
                    "registry" if sock is self._registry_sock else "routing"
                ).inc()
                continue
            handler(sock, frames[0], frames[1])

    def _on_registry(self, sock: zmq.Socket, peer: bytes, payload: bytes) -> None:
        try:
            msg = p.registry_message_decoder.decode(payload)
        except msgspec.DecodeError as err:
            self.metrics.bad_messages.labels("registry").inc()
            log.warning("undecodable registry message dropped: %s", err)
            return
        now = self._clock()
        reply: p.RegistryReply | None
        match msg:
            case p.Register():
                self.metrics.registry_messages.labels("register").inc()
                self.registry.register(msg, now)
                reply = p.RegistryAck(msg.replica_id, self.config.lease_s)
            case p.Heartbeat():
                self.metrics.registry_messages.labels("heartbeat").inc()
                if self.registry.heartbeat(msg.replica_id, msg.load, now):
                    reply = p.RegistryAck(msg.replica_id, self.config.lease_s)
                else:
                    reply = p.ReRegister(msg.replica_id)
            case p.Deregister():
                self.metrics.registry_messages.labels("deregister").inc()
                self.registry.deregister(msg.replica_id, msg.reason)
                reply = p.RegistryAck(msg.replica_id, 0.0)
        sock.send_multipart([peer, p.encode(reply)], zmq.NOBLOCK)

    def _on_routing(self, sock: zmq.Socket, peer: bytes, payload: bytes) -> None:
        try:
            msg = p.routing_message_decoder.decode(payload)
        except msgspec.DecodeError as err:
            self.metrics.bad_messages.labels("routing").inc()
            log.warning("undecodable routing message dropped: %s", err)
            return
        reply: p.RoutingReply
        match msg:
            case p.Route():
                reply = self.route(msg)
            case p.Release():
                replica = self.registry.get(msg.replica_id)
                if replica is not None and replica.in_flight > 0:
                    replica.in_flight -= 1
                return
            case p.ListModels():
                reply = p.ModelList(
                    msg.request_id,
                    [
                        p.ModelInfo(id=m, replicas=n)
                        for m, n in sorted(self.registry.models().items())
                    ],
                )
            case p.ListReplicas():
                now = self._clock()
                reply = p.ReplicaList(msg.request_id, [r.info(now) for r in self.registry])
        sock.send_multipart([peer, p.encode(reply)], zmq.NOBLOCK)

    def route(self, msg: p.Route) -> p.RouteReply:
        started = time.perf_counter()
        candidates = self.registry.for_model(msg.model)
        replica = self.policy.pick(candidates)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if replica is None:
            self.metrics.routes.labels("no_replica").inc()
            return p.RouteReply(msg.request_id, error="no_replica")
        replica.in_flight += 1
        self.metrics.routes.labels("routed").inc()
        return p.RouteReply(msg.request_id, replica.replica_id, replica.spec.url)

    def _publish_gauges(self) -> None:
        models = self.registry.models()
        for model in self._published_models - models.keys():
            self.metrics.replicas.labels(model).set(0)
        for model, count in models.items():
            self.metrics.replicas.labels(model).set(count)
        self._published_models = set(models)
