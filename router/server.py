"""The router process: the registry and KV relay sockets for engines, the routing socket
for gateways.

All are ZeroMQ ROUTER sockets the router binds (it is the stable side); engines' agents
and gateways connect DEALERs. One thread owns the sockets and polls them with a timeout,
so lease expiry runs even when no message arrives. The registry and KV relay sockets are
libzmq's; the routing socket speaks ZMTP on plain sockets in the same poll
(contracts/zmtp.py: no libzmq I/O thread between a gateway's Route and the decision).
Every one of them is CURVE (`router.curve_dir`, by default <state_dir>/curve): the registry
and KV relay sockets admit the engine key, the routing socket the gateway key
(contracts/zmtp_curve.py). Plain only when the config asks for it: `router.allow_plain_loopback`
(loopback binds) or `router.allow_plain_remote` (any bind).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from zmq.auth.thread import ThreadAuthenticator

from hpcserve.config import PlatformConfig, RouterConfig
from hpcserve.contracts import protocol as p
from hpcserve.contracts.curve import (
    CurveError,
    check_plain_allowed,
    check_plain_bind,
    make_server,
    start_authenticator,
)
from hpcserve.contracts.health_policy import severity, worst_action
from hpcserve.contracts.light_metrics import Counter as LightCounter
from hpcserve.contracts.light_metrics import Histogram as LightHistogram
from hpcserve.contracts.light_metrics import LightCollector
from hpcserve.contracts.protocol import OVER_QUEUE_BUDGET
from hpcserve.contracts.zmtp import ZmtpRouter
from hpcserve.contracts.zmtp_curve import routing_server_keys
from hpcserve.router.adapters import NO_REPLICA, AdapterCatalog, AdapterRouter
from hpcserve.router.aliases import ALIAS_NO_REPLICA, AliasCatalog, AliasRouter
from hpcserve.router.decide import Decider
from hpcserve.router.health_events import HealthEventLog
from hpcserve.router.in_flight_book import InFlightBook
from hpcserve.router.kv_subscriber import KvEventSubscriber
from hpcserve.router.policies.pd_roles import near_tier
from hpcserve.router.prefix_index import PrefixIndex
from hpcserve.router.queue_wait import within_budget
from hpcserve.router.quota_book import QuotaBook
from hpcserve.router.registry import Registry, Replica
from hpcserve.router.unserved import UnservedModels

log = logging.getLogger(__name__)

# Where a disaggregated request's decode replica is, seen from its prefill replica
# (hpcserve_router_pd_routes_total{placement}; also other_node, and whole: no prefill).
SAME_NODE, SAME_SWITCH = "same_node", "same_switch"


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
        # The route path's two, routes and decision_seconds, are light metrics
        # (contracts/light_metrics.py): every route is handled by the server's loop or under
        # its lock, one at a time.
        self.routes = LightCounter(
            "hpcserve_router_routes_total", "Routing decisions by outcome", ["outcome"]
        )
        self.routed = self.routes.labels("routed")  # the hot path's child, looked up once
        self.pd_routes = Counter(
            "hpcserve_router_pd_routes_total",
            "Disaggregated requests by placement: prefill and decode on the same node, on "
            "the same leaf switch, on other nodes, or served whole (no prefill replica usable)",
            ["placement"],
            registry=registry,
        )
        self.health_findings = Counter(
            "hpcserve_router_health_findings_total",
            "Health findings engines reported, by check and action",
            ["check", "action"],
            registry=registry,
        )
        self.canary_checks = Counter(
            "hpcserve_router_canary_checks_total",
            "Numerical canary checks engines ran (before registering, periodic), by version "
            "and result (pass, mismatch, error)",
            ["model_ref", "stage", "result"],
            registry=registry,
        )
        self.kv_transfer_removed = Counter(
            "hpcserve_router_kv_transfer_removed",
            "Entries engines' janitors removed from a pool's kv_transfer_dir (the CPU build's "
            "KV-transfer files), by reason (ttl: past kv_transfer_ttl_s; cap: the oldest "
            "beyond kv_transfer_max_mb)",
            ["pool", "reason"],
            registry=registry,
        )
        self.kv_transfer_removed_bytes = Counter(
            "hpcserve_router_kv_transfer_removed_bytes",
            "Bytes of those entries, by reason",
            ["pool", "reason"],
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
        self.connection_releases = Counter(
            "hpcserve_router_connection_releases_total",
            "Requests in flight released because the routing connection that counted them "
            "closed (its gateway declares those still running again)",
            registry=registry,
        )
        self.decision_seconds = LightHistogram(
            "hpcserve_router_decision_seconds",
            "Time to pick a replica",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2),
        )
        registry.register(LightCollector([self.routes, self.decision_seconds]))


class _RefusedConnections(Collector):
    """Routing connections that ended before their CURVE handshake did (no key, a wrong
    one, or plain), read from the socket at scrape time."""

    def __init__(self, server: RouterServer) -> None:
        self.server = server

    def collect(self) -> Iterator[CounterMetricFamily]:
        routing = self.server._routing
        yield CounterMetricFamily(
            "hpcserve_router_routing_refused",
            "Routing connections refused at the CURVE handshake",
            value=routing.refused if routing is not None else 0,
        )


def router_for(config: PlatformConfig, metrics_registry: CollectorRegistry) -> RouterServer:
    """The router `hpcserve router` runs (and a gateway with `gateway.embed_router`): LoRA
    adapters, aliases and canary shares from the model registry; after a restart, a lease's
    grace while the running engines re-register (gateways wait, not fail). Not bound yet."""
    return RouterServer(
        config.router,
        metrics_registry=metrics_registry,
        adapters=AdapterRouter(AdapterCatalog.from_registry(config.registry_path())),
        aliases=AliasRouter(
            AliasCatalog.from_registry(
                config.registry_path(), refresh_s=config.router.alias_refresh_s
            )
        ),
        restart_grace_s=config.router.lease_s,
    )


class RouterServer:
    def __init__(
        self,
        config: RouterConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context | None = None,
        adapters: AdapterRouter | None = None,
        aliases: AliasRouter | None = None,
        routing_socket: str = "zmtp",
        restart_grace_s: float = 0.0,
    ) -> None:
        """routing_socket: "zmtp" (contracts/zmtp.py), or "libzmq" (a libzmq ROUTER, kept to
        compare the two in bench/router_roundtrip.py). restart_grace_s: for this long after
        `bind`, a model with no replica is answered ROUTER_STARTING, not no_replica: the
        engines of a running fleet re-register at their next heartbeat, and gateways ask
        again meanwhile instead of failing the request (`hpcserve router`: router.lease_s)."""
        self.config = config
        self.restart_grace_s = restart_grace_s
        self._grace_until = 0.0
        self.adapters = adapters or AdapterRouter(AdapterCatalog.empty(), clock=clock)
        self.registry = Registry(config.lease_s)
        self.quotas = QuotaBook()
        # New at every start: the quota book's, and in RouteReply for in-flight re-declaration.
        self.epoch = self.quotas.epoch
        self.health_log = HealthEventLog()
        # Routes that found no replica, per model (a pool at zero wakes on them), and per
        # registry version an unserved alias or adapter resolved to.
        self.unserved = UnservedModels()
        self.unserved_refs = UnservedModels()
        # Node -> its leaf switch, from the pool manager (ListReplicas.node_switches): the
        # decode replica's locality after its node. Empty: no switch topology known.
        self.node_switches: dict[str, str] = {}
        prom = metrics_registry or CollectorRegistry()
        self.metrics = RouterMetrics(prom)
        prom.register(_RefusedConnections(self))
        self._clock = clock
        self._ctx = context or zmq.Context.instance()
        # KV-cache-aware routing (router/decide.py); the subscriber's sockets join the loop.
        self.kv_events = KvEventSubscriber(
            PrefixIndex(),
            clock=clock,
            silence_s=config.routing.kv_silence_s,
            context=self._ctx,
            metrics_registry=prom,
        )
        self.decider = Decider(
            config.routing,
            self.registry,
            index=self.kv_events.index,
            subscriber=self.kv_events,
            metrics_registry=prom,
        )
        self.registry.on_add.append(self.decider.replica_added)
        self.registry.on_remove.append(self.decider.replica_removed)
        # Registry aliases and canaries (router/aliases.py).
        self.aliases = aliases or AliasRouter(AliasCatalog.empty())
        self.aliases.attach(self.registry)
        self._stop = threading.Event()
        self._registry_sock: zmq.Socket | None = None
        self._routing_sock: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._routing: ZmtpRouter | None = None
        # Requests in flight by the routing connection that counted them (released when it
        # drops; its gateway declares them again on its next connection).
        self.in_flight_book = InFlightBook()
        if routing_socket not in ("zmtp", "libzmq"):
            raise ValueError(f"routing_socket {routing_socket!r}: expected zmtp or libzmq")
        self._routing_socket = routing_socket
        self._auth: ThreadAuthenticator | None = None
        self.ready = threading.Event()
        # Held while the loop handles what a poll returned; a gateway that embeds this
        # server (gateway/embedded_router.py) routes from its own thread under it.
        self.lock = threading.Lock()
        self._loop_thread = 0
        # Registry-socket messages made on another thread (a LoRA load a Route asked for):
        # the socket is this loop's alone, so they wait here and a byte on _wake says so.
        self._registry_outbox: list[list[bytes]] = []
        self._wake_read: socket.socket | None = None
        self._wake: socket.socket | None = None
        self._published_models: set[str] = set()
        # What engines' agents dial to relay KV events (told in RegistryAck; "": none).
        self.kv_relay = ""

    def _unserved(
        self, request_id: int, error: str, model: str = "", *, served: str = "", ref: str = ""
    ) -> p.RouteReply:
        """A Route no replica can take: during the restart grace, while the fleet's engines
        re-register, "ask again" (p.ROUTER_STARTING) instead of a missing replica. The model
        asked for is recorded as unserved demand (router/unserved.py: it wakes a pool at zero),
        and what it resolved to: `served`, the served name an alias routes to, and `ref`, the
        registry version an alias or adapter with no replica resolves to."""
        now = self._clock()
        for book, name in (
            (self.unserved, model), (self.unserved, served), (self.unserved_refs, ref)
        ):  # fmt: skip
            if name:
                book.missed(name, now)
        if error in (NO_REPLICA, ALIAS_NO_REPLICA) and self._clock() < self._grace_until:
            error = p.ROUTER_STARTING
        self.metrics.routes.labels(error).inc()
        return p.RouteReply(request_id, error=error, model_ref=ref)

    def bind(self) -> None:
        self._grace_until = self._clock() + self.restart_grace_s
        # CURVE on every socket (contracts/curve.py); plain only when the config asks, and
        # on a non-loopback bind only with allow_plain_remote.
        config = self.config
        curve_dir = config.curve_dir
        relay_bind = config.kv_relay_binds()
        try:
            check_plain_allowed(curve_dir, config.allow_plain_loopback, config.allow_plain_remote)
            for endpoint, setting, what in (
                (config.registry_bind, "router.registry_bind", "the registry"),
                (config.routing_bind, "router.routing_bind", "the routing socket"),
                (relay_bind, "router.kv_relay_bind", "the KV relay socket"),
            ):
                check_plain_bind(endpoint, curve_dir, config.allow_plain_remote, setting, what)
            routing_keys = routing_server_keys(curve_dir)
            if routing_keys is not None and self._routing_socket != "zmtp":
                raise CurveError("the libzmq routing socket (a benchmark's) has no CURVE")
            if curve_dir:
                self._auth = start_authenticator(self._ctx, Path(curve_dir))
            self._registry_sock = self._bind(config.registry_bind, curve_dir)
            if config.routing.kv_events:
                bound = self.kv_events.bind_relay(relay_bind, curve_dir)
                self.kv_relay = config.kv_relay_dial(bound)
            if self._routing_socket == "zmtp":
                try:
                    self._routing = ZmtpRouter(
                        config.routing_bind,
                        self._poller,
                        on_drop=self._connection_gone,
                        curve=routing_keys,
                    )
                except ValueError as err:
                    raise RuntimeError(str(err)) from None
                self._routing.bind()
            else:
                self._routing_sock = self._bind(config.routing_bind)
        except RuntimeError:
            # Nothing of this server stays open when it cannot start (a caller may retry).
            if self._registry_sock is not None:
                self._registry_sock.close(0)
                self._registry_sock = None
            self._routing = None
            self.kv_events.close()
            if self._auth is not None:
                self._auth.stop()
            raise
        if not curve_dir:
            log.warning(
                "plain sockets (router.allow_plain_%s): any process that reaches them, any "
                "user of this host included, can register replicas, route and read the "
                "replica list; leave router.curve_dir to its default on a host others log in to",
                "remote" if config.allow_plain_remote else "loopback",
            )
        log.info(
            "router listening: registry %s, routing %s, KV relay %s (%s)",
            config.registry_bind,
            config.routing_bind,
            self.kv_events.relay_endpoint or "off",
            "CURVE" if curve_dir else "plain",
        )

    def _bind(self, endpoint: str, curve_dir: str = "") -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve_dir:
            make_server(sock, Path(curve_dir))
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
        self._poke()

    def _poke(self) -> None:
        """Wake the loop from its poll (from another thread)."""
        if self._wake is None:
            return
        with contextlib.suppress(OSError):  # a byte already waits, or the loop has ended
            self._wake.send(b"x")

    def _send_registry(self, frames: list[bytes]) -> None:
        assert self._registry_sock is not None
        if self._loop_thread in (0, threading.get_ident()):  # not serving, or this loop
            self._registry_sock.send_multipart(frames, zmq.NOBLOCK)
        else:
            self._registry_outbox.append(frames)
            self._poke()

    def serve_forever(self) -> None:
        if self._registry_sock is None:
            self.bind()
        assert self._registry_sock is not None
        poller = self._poller
        poller.register(self._registry_sock, zmq.POLLIN)
        if self._routing_sock is not None:
            poller.register(self._routing_sock, zmq.POLLIN)
        poller.register(self.kv_events.sub, zmq.POLLIN)
        relay = self.kv_events.relay
        if relay is not None:
            poller.register(relay, zmq.POLLIN)
        tick_s = min(self.config.lease_s / 4, 0.5)
        next_housekeeping = 0.0
        self._wake_read, self._wake = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake.setblocking(False)
        poller.register(self._wake_read, zmq.POLLIN)
        self._loop_thread = threading.get_ident()
        self.ready.set()
        try:
            while not self._stop.is_set():
                replays = self.kv_events.replay_sockets()
                events = dict(poller.poll(10 if replays else int(tick_s * 1000)))
                with self.lock:
                    next_housekeeping = self._handle(events, replays, next_housekeeping)
        finally:
            self._registry_sock.close(0)
            if self._routing is not None:
                self._routing.close()
            if self._routing_sock is not None:
                self._routing_sock.close(0)
            self.kv_events.close()
            if self._auth is not None:
                self._auth.stop()
            wake, self._wake = self._wake, None  # no _poke writes to it from now on
            wake.close()
            self._wake_read.close()
            log.info("router stopped")

    def _handle(self, events: dict, replays: list, next_housekeeping: float) -> float:
        """What one poll returned (with the lock held); the next housekeeping time."""
        assert self._registry_sock is not None
        relay = self.kv_events.relay
        wake = self._wake_read
        if wake is not None and wake in events:
            with contextlib.suppress(OSError):  # BlockingIOError: all read
                while wake.recv(4096):
                    pass
        if self._registry_outbox:
            outbox, self._registry_outbox = self._registry_outbox, []
            for frames in outbox:
                self._registry_sock.send_multipart(frames, zmq.NOBLOCK)
        if self.kv_events.sub in events:
            self.kv_events.drain()
        if relay is not None and relay in events:
            self.kv_events.drain_relay()
        for replay in replays:
            self.kv_events.on_replay(replay)
        if self._registry_sock in events:
            self._drain(self._registry_sock, self._on_registry)
        if self._routing is not None:
            self._serve_routing(self._routing, events)
        elif self._routing_sock is not None and self._routing_sock in events:
            self._drain_routing(self._routing_sock)
        now = self._clock()
        if now >= next_housekeeping or replays:
            # Leases, KV-stream timers and gauges: at most this often, not on every message.
            next_housekeeping = now + min(self.config.lease_s / 4, 0.05)
            self.kv_events.tick()
            self.decider.record_routed()
            self.decider.approx.expire(now)
            # Heartbeats that queued while this thread was not running (a paused
            # process) count before any lease is judged lapsed.
            self._drain(self._registry_sock, self._on_registry)
            for _ in self.registry.expire(now):
                self.metrics.lease_expiries.inc()
            self._publish_gauges()
        return next_housekeeping

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

    def _serve_routing(self, routing: ZmtpRouter, events: dict) -> None:
        """A gateway sends the messages of one event-loop iteration as the frames of one
        message; the replies go back the same way."""
        on_routing = self._on_routing
        for peer, frames in routing.receive(events):
            replies = [r for f in frames if (r := on_routing(f, peer)) is not None]
            if replies:
                routing.send(peer, replies)
            self.decider.record_routed()

    def _drain_routing(self, sock: zmq.Socket) -> None:
        """A gateway sends the messages of one event-loop iteration as the frames of one
        multipart message ([peer, msg, msg, ...]); the replies go back the same way."""
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                self.metrics.bad_messages.labels("routing").inc()
                continue
            replies = [r for r in map(self._on_routing, frames[1:]) if r is not None]
            if replies:
                sock.send_multipart([frames[0], *replies], zmq.NOBLOCK)
            self.decider.record_routed()

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
                self.adapters.on_register(msg, peer)
                reply = p.RegistryAck(msg.replica_id, self.config.lease_s, self.kv_relay)
            case p.Heartbeat():
                self.metrics.registry_messages.labels("heartbeat").inc()
                if self.registry.heartbeat(msg.replica_id, msg.load, now):
                    self.adapters.on_heartbeat(msg, peer)
                    reply = p.RegistryAck(msg.replica_id, self.config.lease_s, self.kv_relay)
                else:
                    reply = p.ReRegister(msg.replica_id)
            case p.Deregister():
                self.metrics.registry_messages.labels("deregister").inc()
                self.registry.deregister(msg.replica_id, msg.reason)
                self.adapters.forget(msg.replica_id)
                reply = p.RegistryAck(msg.replica_id, 0.0)
            case p.HealthReport():
                reply = self._on_health_report(msg)
            case p.AdapterLoaded():
                self.metrics.registry_messages.labels("adapter_loaded").inc()
                self.adapters.on_loaded(msg)
                return
            case p.CanaryReport():
                self.metrics.registry_messages.labels("canary_report").inc()
                self.metrics.canary_checks.labels(msg.model_ref, msg.stage, msg.result).inc()
                return
            case p.KvCleanupReport():
                self.metrics.registry_messages.labels("kv_cleanup_report").inc()
                self._on_kv_cleanup(msg)
                return
        sock.send_multipart([peer, p.encode(reply)], zmq.NOBLOCK)

    def _on_kv_cleanup(self, msg: p.KvCleanupReport) -> None:
        """Counted under the replica's registered pool (a pool name, never the message's)."""
        replica = self.registry.get(msg.replica_id)
        if replica is None:
            return  # not registered (yet, or any more): its pool is unknown
        pool = replica.spec.pool
        for reason, count, size in (
            ("ttl", msg.expired, msg.expired_bytes),
            ("cap", msg.over_cap, msg.over_cap_bytes),
        ):
            if count > 0:
                self.metrics.kv_transfer_removed.labels(pool, reason).inc(count)
            if size > 0:
                self.metrics.kv_transfer_removed_bytes.labels(pool, reason).inc(size)

    def _on_routing(self, payload: bytes, peer: bytes = b"") -> bytes | None:
        """One gateway message; its encoded reply (None: it has none). `peer`: the routing
        connection it came by, which books its requests in flight (b"": none books them)."""
        try:
            msg = p.routing_message_decoder.decode(payload)
        except msgspec.DecodeError as err:
            self.metrics.bad_messages.labels("routing").inc()
            log.warning("undecodable routing message dropped: %s", err)
            return None
        reply = self.handle(msg, peer)
        return None if reply is None else p.encode(reply)

    def handle(self, msg: p.RoutingMessage, peer: bytes = b"") -> p.RoutingReply | None:
        """One gateway message, decoded; its reply (None: it has none). Called on this
        server's loop, or with `lock` held by a gateway that embeds it."""
        reply: p.RoutingReply
        match msg:
            case p.Route():
                reply = self.route(msg, peer)
                if peer and reply.replica_id:
                    self.in_flight_book.booked(peer, reply.replica_id, msg.model)
                    if reply.prefill_replica_id:
                        self.in_flight_book.booked(peer, reply.prefill_replica_id, msg.model)
            case p.Release():
                self._released_by(peer, msg.replica_id, msg.model)
                return None
            case p.InFlight():
                self._declared(msg, peer)
                return None
            case p.ListModels():
                reply = p.ModelList(
                    msg.request_id,
                    [
                        p.ModelInfo(id=m, replicas=n)
                        for m, n in sorted(self.registry.models().items())
                    ]
                    + self.adapters.listing(self.registry)
                    + self.aliases.listing(self.registry),
                )
            case p.ListReplicas():
                now = self._clock()
                if msg.node_switches is not None:
                    self._set_topology(msg.node_switches)
                switches = self.node_switches
                reply = p.ReplicaList(
                    msg.request_id,
                    [r.info(now, switches.get(r.spec.node, "")) for r in self.registry],
                    self.epoch,
                    {a.name: a.target for a in self.aliases.catalog.all()},
                    unserved=self.unserved.ages(now),
                    unserved_refs=self.unserved_refs.ages(now),
                )
            case p.QuotaReport():
                reply = self.quotas.report(msg, self._clock())
            case p.ListHealthEvents():
                events = self.health_log.since(msg.epoch, msg.ack_seq)
                reply = p.HealthEvents(msg.request_id, self.health_log.epoch, events)
        return reply

    def _set_topology(self, node_switches: dict[str, str]) -> None:
        if node_switches == self.node_switches:
            return
        self.node_switches = dict(node_switches)
        if node_switches:
            log.info(
                "switch topology: %d nodes under %d leaf switches (decode replicas on the "
                "prefill's switch come after those on its node)",
                len(node_switches),
                len(set(node_switches.values())),
            )
        else:
            log.info("no switch topology: decode locality is by node only")

    def _on_health_report(self, msg: p.HealthReport) -> p.RegistryReply:
        """Record the findings for the pool manager; stop routing to the replica at once
        when one asks for stop_routing or worse (in-flight requests are not touched)."""
        self.metrics.registry_messages.labels("health_report").inc()
        self.health_log.add(msg, time.time())
        for finding in msg.findings:
            self.metrics.health_findings.labels(finding.check, finding.action).inc()
        details = "; ".join(f.detail for f in msg.findings)
        if severity(worst_action(msg.findings)) < severity("stop_routing"):
            log.warning("replica %s health: %s", msg.replica_id, details)
            return p.RegistryAck(msg.replica_id, self.config.lease_s)
        self.registry.deregister(msg.replica_id, f"health: {details}")
        self.adapters.forget(msg.replica_id)
        return p.RegistryAck(msg.replica_id, 0.0)

    def _declared(self, msg: p.InFlight, peer: bytes = b"") -> None:
        """A gateway's requests in flight that this router did not route, counted as routed
        (per replica, and per LoRA adapter); releases follow as for any routed request."""
        for i, replica_id in enumerate(msg.replica_ids):
            replica = self.registry.get(replica_id)
            if replica is None:
                continue
            self.registry.routed(replica)
            model = msg.models[i] if i < len(msg.models) else ""
            if peer:
                self.in_flight_book.booked(peer, replica_id, model)
            if model and model != replica.model and self.adapters.is_adapter(model):
                self.adapters.routed(replica_id, model)

    def _released(self, replica_id: str, model: str) -> None:
        self.registry.released(replica_id)
        replica = self.registry.get(replica_id)
        self.adapters.released(replica_id, model, idle=replica is None or not replica.in_flight)

    def _released_by(self, peer: bytes, replica_id: str, model: str) -> None:
        """A Release that came by routing connection `peer`: only what it booked is undone."""
        if peer:
            booked = self.in_flight_book.release(peer, replica_id, model)
            if booked is None:
                return  # booked by a connection that has dropped since: released then
            model = booked
        self._released(replica_id, model)

    def _connection_gone(self, peer: bytes) -> None:
        released = self.in_flight_book.dropped(peer)
        for replica_id, model in released:
            self._released(replica_id, model)
        if released:
            self.metrics.connection_releases.inc(len(released))
            log.info(
                "routing connection %s gone: %d requests it counted in flight released "
                "(its gateway declares those still running again)",
                peer.hex(),
                len(released),
            )

    def route(self, msg: p.Route, peer: bytes = b"") -> p.RouteReply:
        for i, replica_id in enumerate(msg.released):
            model = msg.released_models[i] if i < len(msg.released_models) else ""
            self._released_by(peer, replica_id, model)
        started = time.perf_counter()
        asked = msg.model
        candidates = self.registry.for_model(msg.model)
        served_as = ""
        if not candidates and (alias := self.aliases.resolve(msg, self.registry)) is not None:
            if alias.candidates is None:
                return self._unserved(msg.request_id, alias.error, asked, ref=alias.ref)
            served_as, candidates = alias.model, alias.candidates
            msg = msgspec.structs.replace(msg, model=served_as)
        adapter = not candidates and self.adapters.is_adapter(msg.model)
        if adapter:
            decision = self.adapters.route(
                msg.model,
                self.registry,
                priority=msg.priority,
                lend_below=self.config.routing.batch_lend_below,
            )
            if decision.load is not None and self._registry_sock is not None:
                self._send_registry([decision.peer, p.encode(decision.load)])
            if not decision.candidates:
                return self._unserved(
                    msg.request_id, decision.error, asked, ref=self.adapters.base_of(msg.model)
                )
            candidates = list(decision.candidates)
        if msg.exclude:
            candidates = [r for r in candidates if r.replica_id not in msg.exclude]
        if msg.queue_budget_s > 0 and candidates:
            self.registry.track_service = True
            within, wait_s = within_budget(candidates, msg.queue_budget_s)
            candidates = list(within)
            if not candidates:
                self.metrics.routes.labels(OVER_QUEUE_BUDGET).inc()
                return p.RouteReply(
                    msg.request_id, error=OVER_QUEUE_BUDGET, queue_wait_s=round(wait_s, 3)
                )
        table = self.registry.table(msg.model) if not adapter else None
        if table is not None and table.prefill_rows:
            return self._route_pd(msg, candidates, served_as, asked, started)
        replica = self.decider.pick(msg, self._clock(), candidates)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if replica is None:
            return self._unserved(msg.request_id, NO_REPLICA, asked, served=served_as)
        if adapter:
            self.adapters.routed(replica.replica_id, msg.model)
        self.metrics.routed.inc()
        return p.RouteReply(
            msg.request_id,
            replica.replica_id,
            replica.spec.url,
            model=served_as,
            epoch=self.epoch,
            model_ref=replica.spec.model_ref,
            adapter=msg.model if adapter else "",
        )

    def _route_pd(
        self, msg: p.Route, candidates: list[Replica], served_as: str, asked: str, started: float
    ) -> p.RouteReply:
        """A model with a prefill pool (policies/pd_roles.py): the prefill replica by the
        policy over the prefill rows (prefix overlap, queue), then the decode replica over
        the others (KV headroom, load), on the prefill's node when one there is not
        overloaded, else on its leaf switch when one there is not (pd_roles.near_tier).
        Without a usable prefill replica the decode replica serves it whole."""
        now = self._clock()
        prefill = self.decider.pick(msg, now, candidates, phase="prefill")
        decode_candidates = candidates
        table = self.registry.table(msg.model)
        if prefill is not None and table is not None:
            decoders = [r for r in candidates if r.spec.role != "prefill" and r.routable]
            node = prefill.spec.node
            tiers: list[tuple[str, list[Replica]]] = [
                (SAME_NODE, [r for r in decoders if r.spec.node == node])
            ]
            switches = self.node_switches
            if switch := switches.get(node, ""):
                near = [r for r in decoders if switches.get(r.spec.node) == switch]
                tiers.append((SAME_SWITCH, near))
            load = table.load
            tier = near_tier(
                tiers,
                lambda r: float(load[r.row]),
                table.load_floor(),
                self.config.routing.overload_abs,
            )
            if tier is not None:
                decode_candidates = list(tier[1])
        replica = self.decider.pick(msg, now, decode_candidates)
        if replica is None and decode_candidates is not candidates:
            replica = self.decider.pick(msg, now, candidates)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if replica is not None and prefill is not None and replica.spec.role != "decode":
            # Only a decode replica loads a transferred prompt: serve it whole there.
            self.registry.released(prefill.replica_id)
            prefill = None
        if replica is None:
            if prefill is not None:
                self.registry.released(prefill.replica_id)
            return self._unserved(msg.request_id, NO_REPLICA, asked, served=served_as)
        self.metrics.routed.inc()
        self.metrics.pd_routes.labels(self._placement(prefill, replica)).inc()
        return p.RouteReply(
            msg.request_id,
            replica.replica_id,
            replica.spec.url,
            model=served_as,
            epoch=self.epoch,
            model_ref=replica.spec.model_ref,
            prefill_replica_id=prefill.replica_id if prefill is not None else "",
            prefill_url=prefill.spec.url if prefill is not None else "",
        )

    def _placement(self, prefill: Replica | None, decode: Replica) -> str:
        if prefill is None:
            return "whole"
        if prefill.spec.node == decode.spec.node:
            return SAME_NODE
        switch = self.node_switches.get(prefill.spec.node, "")
        if switch and self.node_switches.get(decode.spec.node) == switch:
            return SAME_SWITCH
        return "other_node"

    def _publish_gauges(self) -> None:
        models = self.registry.models()
        for model in self._published_models - models.keys():
            self.metrics.replicas.labels(model).set(0)
        for model, count in models.items():
            self.metrics.replicas.labels(model).set(count)
        self._published_models = set(models)
