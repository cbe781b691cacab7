"""The router inside the gateway's process (`gateway.embed_router`).

The router (router/server.py RouterServer) runs its loop on a thread of this process: it
binds the same registry, KV relay and routing sockets `hpcserve router` binds, so engines,
the pool manager, `hpcserve status` and other gateways (the other workers of this one)
reach it as before. This gateway's own requests do not go through a socket: a Route is a
call to the server under its lock, so a decision costs no encoding, no second process
waking and no round trip (docs/benchmarks.md, "The router in the gateway"). The server's
thread takes the lock only while it handles what a poll returned.

Same interface as gateway/routing_client.py RoutingClient, less what a connection needs:
the router cannot be away (it lives and dies with this process), so there is no fallback
view to route on, no epoch to follow and nothing to declare again; a Release is counted at
once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import threading
import time
from typing import Any, Protocol, TypeVar

from hpcserve.contracts import protocol as p
from hpcserve.gateway.replica_view import ReplicaView
from hpcserve.gateway.routing_client import RouterUnavailable
from hpcserve.gateway.running_loop import RunningLoop

log = logging.getLogger(__name__)

R = TypeVar("R", bound=p.RoutingReply)
# How often a Route that found the router starting, or a LoRA adapter loading, asks again.
RETRY_S = 0.05


class EmbeddableRouter(Protocol):
    """What this module needs of router/server.py RouterServer (the gateway does not import
    the router: `hpcserve gateway` passes one in, made by the command line)."""

    lock: threading.Lock
    ready: threading.Event
    epoch: str

    def serve_forever(self) -> None: ...
    def stop(self) -> None: ...
    def handle(self, msg: p.RoutingMessage, peer: bytes = b"") -> p.RoutingReply | None: ...


class EmbeddedRouting:
    def __init__(
        self,
        server: EmbeddableRouter,
        *,
        adapter_wait_s: float = 60.0,
        view_refresh_s: float = 2.0,
        view_max_age_s: float = 300.0,
    ) -> None:
        """server: bound (RouterServer.bind), not yet serving; `start` runs its loop."""
        self.server = server
        self.endpoint = "embedded"
        self.adapter_wait_s = adapter_wait_s
        # What the gateway reads between requests (prefix hints: a model's replica count and
        # an alias's served name): copied from the server every view_refresh_s, as a
        # RoutingClient's is, so that reading it takes no lock.
        self.view = ReplicaView(view_max_age_s, clock=time.monotonic)
        self.view_refresh_s = view_refresh_s
        self.epoch = server.epoch
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._viewer: asyncio.Task[None] | None = None
        self._batch: list[tuple[p.Route, asyncio.Future[p.RouteReply]]] = []
        self._loop = RunningLoop()
        # Replicas routed to and not released yet (a prefill and its decode count two): with
        # none, no other request of this gateway is past its Route, and a decision waits
        # for no batch (see _decided). A heuristic only: a count off by some costs time.
        self._unreleased = 0

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="embedded-router", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self.server.ready.wait)
        self._copy_view()
        self._viewer = asyncio.create_task(self._refresh_view(), name="embedded-router-view")
        log.info("router embedded in this gateway process (gateway.embed_router)")

    def _serve(self) -> None:
        try:
            self.server.serve_forever()
        except Exception:
            # Without the loop no engine registers and no lease expires: this gateway
            # stops (gracefully, as on SIGTERM) and its supervisor starts it again.
            log.critical("embedded router failed: stopping this gateway", exc_info=True)
            os.kill(os.getpid(), signal.SIGTERM)

    async def close(self) -> None:
        if self._viewer is not None:
            self._viewer.cancel()
            await asyncio.gather(self._viewer, return_exceptions=True)
        self.server.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def _handle(self, msg: p.RoutingMessage) -> p.RoutingReply | None:
        with self.server.lock:
            return self.server.handle(msg)

    def _ask(self, make: type, reply_type: type[R], **fields: object) -> R:
        reply = self._handle(make(request_id=next(self._ids), **fields))
        assert isinstance(reply, reply_type)
        return reply

    def _copy_view(self) -> None:
        listed = self._ask(p.ListReplicas, p.ReplicaList)
        self.view.update(listed.replicas, listed.aliases)

    async def _refresh_view(self) -> None:
        while True:
            await asyncio.sleep(self.view_refresh_s)
            self._copy_view()

    # --- requests ---------------------------------------------------------------------
    async def route(
        self,
        model: str,
        *,
        priority: str = "interactive",
        exclude: list[str] | None = None,
        **hints: Any,
    ) -> p.RouteReply:
        """`hints`: Route's prefix-routing fields (contracts/prompt_tokens.py RouteHints).
        While the router has just started (its engines re-register within a lease) or loads
        the LoRA adapter `model` names, asks again every RETRY_S, up to adapter_wait_s."""
        if exclude:
            hints["exclude"] = exclude
        give_up_at = time.monotonic() + self.adapter_wait_s
        while True:
            reply = await self._decided(p.Route(next(self._ids), model, priority=priority, **hints))
            waiting = reply.error in ("adapter_loading", p.ROUTER_STARTING)
            if not waiting or time.monotonic() >= give_up_at:
                return reply
            await asyncio.sleep(RETRY_S)

    def _decided(self, route: p.Route) -> asyncio.Future[p.RouteReply]:
        """The Route's reply, decided with the others of this loop iteration: each
        request's task runs its steps up to here, then the decisions run together under
        one lock, as a router process answers a batch (one message of many Routes) at
        concurrency; a request's whole path run at once, parse to relay, costs more.
        When no other routed request is in flight (concurrency 1), there is no batch to
        wait for: the decision runs now, and the request does not pass through two more
        loop iterations (docs/benchmarks.md, issue 23's ninth pass)."""
        loop = self._loop.get()
        future: asyncio.Future[p.RouteReply] = loop.create_future()
        if self._unreleased <= 0 and not self._batch:
            with self.server.lock:
                self._decide(route, future)
            return future
        self._batch.append((route, future))
        if len(self._batch) == 1:
            loop.call_soon(self._decide_batch)
        return future

    def _decide_batch(self) -> None:
        batch, self._batch = self._batch, []
        with self.server.lock:
            for route, future in batch:
                self._decide(route, future)

    def _decide(self, route: p.Route, future: asyncio.Future[p.RouteReply]) -> None:
        """One Route, under the server's lock."""
        server = self.server
        try:
            reply = server.handle(route)
            assert isinstance(reply, p.RouteReply)
        except Exception as err:  # a bug must cost this request a 503, not a hang
            log.exception("embedded router: Route for %s failed", route.model)
            if not future.done():
                future.set_exception(RouterUnavailable(f"embedded router: {err!r}"))
            return
        if not future.done():
            self._unreleased += bool(reply.replica_id) + bool(reply.prefill_replica_id)
            future.set_result(reply)
            return
        # Its request gave up meanwhile (client gone): counted, so released.
        for replica_id in (reply.replica_id, reply.prefill_replica_id):
            if replica_id:
                server.handle(p.Release(replica_id, route.model))

    def release(self, replica_id: str, model: str = "") -> None:
        """A routed request finished (`model`: what it asked for; the router counts LoRA
        adapters in flight)."""
        self.view.released(replica_id)
        self._unreleased -= 1
        self._handle(p.Release(replica_id, model))

    async def sync_quota(self, gateway_id: str, usage: list[p.TenantUsage]) -> p.QuotaTotals:
        return self._ask(p.QuotaReport, p.QuotaTotals, gateway_id=gateway_id, usage=usage)

    async def models(self) -> p.ModelList:
        return self._ask(p.ListModels, p.ModelList)

    async def replicas(self) -> p.ReplicaList:
        return self._ask(p.ListReplicas, p.ReplicaList)
