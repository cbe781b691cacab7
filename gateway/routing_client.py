"""The gateway's side of the routing conversation with the router.

The router binds a ZeroMQ ROUTER; this side is a DEALER driven straight from the event loop
(gateway/zmtp_dealer.py speaks ZeroMQ's wire protocol on the loop's own connection), so a
request costs one write and one read on the loop, no libzmq I/O thread, no zmq.asyncio
future. Requests made in one loop iteration leave together as the frames of one multipart
message; the router answers with one multipart message of replies, matched to waiting
requests by request id. Releases ride on the next Route (or leave alone after
``RELEASE_DELAY_S``).

The router counts requests in flight per replica (and per LoRA adapter) in memory. Its
replies carry its epoch, new at each start; a gateway that sees a new epoch knows that router
counts none of its requests yet, and declares those still in flight (`InFlight`) for the
replicas the new router lists, once they have re-registered; so do requests routed on the
fallback view while the router was away. A request the router never counted is not released
to it. The same happens when the connection to the same router drops (a network blip): the
router releases everything that connection counted (router/in_flight_book.py), since a
Release or InFlight sent on it may have been lost with it, and this side declares again on
the next connection what is still in flight; nothing queued for the old connection but
Routes is sent on the new one. Routes and listings sent on the lost connection and not
answered are sent again on the next one (without the Releases folded into them), rather than
waiting out their deadline: the router released whatever the lost connection counted.

Every wait has a deadline (`gateway.route_timeout_s`): a router that does not answer costs
a 503, never a hung request. While no router is connected, messages wait in the outbox (as
ZMQ_IMMEDIATE did: nothing is sent towards a router that is not there), up to that deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any, Protocol, TypeVar

import msgspec

from hpcserve.contracts import protocol as p
from hpcserve.contracts.zmtp_curve import ClientKeys
from hpcserve.gateway.replica_view import ReplicaView
from hpcserve.gateway.zmtp_dealer import ZmtpDealer

log = logging.getLogger(__name__)

R = TypeVar("R", bound=p.RoutingReply)
# A Release waits at most this long for a Route to ride on.
RELEASE_DELAY_S = 0.002
# At most this many messages leave as one multipart message.
MAX_FRAMES = 256
# Asked again on a new connection when the one they were sent on is lost before the answer
# (not QuotaReport: it carries usage the router may have counted already).
_RESENDABLE = (p.Route, p.ListModels, p.ListReplicas)


class RouterUnavailable(Exception):
    pass


class Routing(Protocol):
    """What the gateway asks of the router: RoutingClient (another process, over the
    routing socket) or gateway/embedded_router.py EmbeddedRouting (this one)."""

    endpoint: str
    view: ReplicaView

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def route(
        self,
        model: str,
        *,
        priority: str = "interactive",
        exclude: list[str] | None = None,
        **hints: Any,
    ) -> p.RouteReply: ...
    def release(self, replica_id: str, model: str = "") -> None: ...
    async def sync_quota(self, gateway_id: str, usage: list[p.TenantUsage]) -> p.QuotaTotals: ...
    async def models(self) -> p.ModelList: ...
    async def replicas(self) -> p.ReplicaList: ...


class RoutingClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        adapter_wait_s: float = 60.0,
        view_refresh_s: float = 2.0,
        view_max_age_s: float = 300.0,
        curve: ClientKeys | None = None,
    ) -> None:
        """curve: the gateway key (contracts/zmtp_curve.py) for a router with CURVE keys."""
        self.endpoint = endpoint
        self.curve = curve
        self.timeout_s = timeout_s
        # The last known replica set, routed on while the router is away.
        self.view = ReplicaView(view_max_age_s, clock=time.monotonic)
        self.view_refresh_s = view_refresh_s
        self._viewer: asyncio.Task[None] | None = None
        # A LoRA adapter loaded on demand (router/adapters.py): how long a request waits.
        self.adapter_wait_s = adapter_wait_s
        self._dealer: ZmtpDealer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        # request id -> (future, deadline on the loop's clock, the request again if it may be
        # re-sent on a new connection, else b"")
        self._pending: dict[int, tuple[asyncio.Future[p.RoutingReply], float, bytes]] = {}
        # (request id, or 0 for a Release; encoded message) not yet sent
        self._outbox: list[tuple[int, bytes]] = []
        self._flush_soon = False
        self._expiry: asyncio.TimerHandle | None = None
        self._released: list[str] = []
        self._released_models: list[str] = []  # what each of _released asked for
        self._release_timer: asyncio.TimerHandle | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        # Requests in flight by (replica id, model asked for): counted by the router of
        # `epoch`, or not known to it (routed by an earlier router, or on the fallback view).
        self.epoch = ""
        self._declared: dict[tuple[str, str], int] = {}
        self._undeclared: dict[tuple[str, str], int] = {}
        self._refresh_now = asyncio.Event()
        self._decode = p.routing_reply_decoder.decode

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._dealer = ZmtpDealer(
            self.endpoint,
            self._on_message,
            self._connected,
            on_lost=self._connection_lost,
            curve=self.curve,
        )
        self._dealer.start()
        self._viewer = asyncio.create_task(self._refresh_view(), name="routing-client-view")
        log.info("routing client connecting to %s", self.endpoint)

    async def _refresh_view(self) -> None:
        while True:
            self._refresh_now.clear()  # a wish to refresh made while listing is kept
            try:
                listed = await self.replicas()
            except RouterUnavailable as err:
                self.view.router_lost(str(err))
            else:
                self._see_epoch(listed.epoch)
                self.view.update(listed.replicas, listed.aliases)
                self._declare({r.replica_id for r in listed.replicas})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refresh_now.wait(), self.view_refresh_s)

    # --- in-flight requests across router restarts --------------------------------------
    def _see_epoch(self, epoch: str) -> None:
        if not epoch or epoch == self.epoch:
            return
        if self.epoch:
            log.info("router restarted (epoch %s): re-declaring requests in flight", epoch)
            for key, count in self._declared.items():
                self._undeclared[key] = self._undeclared.get(key, 0) + count
            self._declared.clear()
            self._refresh_now.set()  # its replica list says which can be declared now
        self.epoch = epoch

    def _connection_lost(self) -> None:
        """The router releases what the lost connection counted: all of it is undeclared
        now; queued Releases and InFlight (for the old connection's counts) are dropped;
        requests sent and not answered are queued again; Routes lose the Releases folded
        into them."""
        for key, count in self._declared.items():
            self._undeclared[key] = self._undeclared.get(key, 0) + count
        self._declared.clear()
        self._take_released()
        queued = {request_id for request_id, _ in self._outbox}
        unanswered = [
            (request_id, again)
            for request_id, (_, _, again) in self._pending.items()
            if again and request_id not in queued
        ]
        self._outbox = [
            (request_id, self._without_releases(payload))
            for request_id, payload in unanswered + self._outbox
            if request_id
        ]

    def _without_releases(self, payload: bytes) -> bytes:
        msg = p.routing_message_decoder.decode(payload)
        if isinstance(msg, p.Route) and msg.released:
            return self._encode(msgspec.structs.replace(msg, released=[], released_models=[]))
        return payload

    def _connected(self) -> None:
        self._flush()
        if self._undeclared:
            self._refresh_now.set()  # the replica list says which can be declared now

    def _declare(self, live: set[str]) -> None:
        """Requests in flight on `live` replicas the router does not count yet: InFlight."""
        if not self.epoch or not self._undeclared:
            return
        replica_ids: list[str] = []
        models: list[str] = []
        for key, count in list(self._undeclared.items()):
            if key[0] in live:
                del self._undeclared[key]
                self._declared[key] = self._declared.get(key, 0) + count
                replica_ids += [key[0]] * count
                models += [key[1]] * count
        if replica_ids:
            self._outbox.append((0, self._encode(p.InFlight(replica_ids, models))))
            self._flush()

    async def close(self) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._send_releases()
        self._flush()
        if self._viewer is not None:
            self._viewer.cancel()
            await asyncio.gather(self._viewer, return_exceptions=True)
        if self._expiry is not None:
            self._expiry.cancel()
        if self._dealer is not None:
            await self._dealer.close()
            self._dealer = None

    # --- the connection -------------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> None:
        pending, decode = self._pending, self._decode
        for payload in frames:
            try:
                reply = decode(payload)
            except msgspec.DecodeError as err:
                log.warning("undecodable reply from router dropped: %s", err)
                continue
            waiting = pending.pop(reply.request_id, None)
            if waiting is not None and not waiting[0].done():
                waiting[0].set_result(reply)
            elif isinstance(reply, p.RouteReply) and reply.replica_id:
                # Its request gave up (deadline, client gone): the router counted it routed.
                self._release_soon(reply.replica_id, "")

    def _send(self, request_id: int, payload: bytes) -> None:
        self._outbox.append((request_id, payload))
        if not self._flush_soon:
            self._flush_soon = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Everything queued in this loop iteration, as one message (MAX_FRAMES at most)."""
        self._flush_soon = False
        dealer = self._dealer
        if dealer is None or not dealer.connected or not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        for at in range(0, len(outbox), MAX_FRAMES):
            dealer.send([payload for _, payload in outbox[at : at + MAX_FRAMES]])

    def _expire(self) -> None:
        """Fail requests past their deadline; re-armed while any wait."""
        self._expiry = None
        assert self._loop is not None
        now = self._loop.time()
        for request_id, (future, deadline, _) in list(self._pending.items()):
            if deadline <= now:
                del self._pending[request_id]
                if not future.done():
                    future.set_exception(self._unavailable())
        if self._outbox:  # a request that waited for a router in vain is not sent later;
            # Releases and InFlight (id 0) are, or the router would count them forever.
            self._outbox = [m for m in self._outbox if not m[0] or m[0] in self._pending]
        self._arm_expiry()

    def _arm_expiry(self) -> None:
        if self._expiry is None and self._pending:
            assert self._loop is not None
            self._expiry = self._loop.call_later(min(self.timeout_s / 4, 0.25), self._expire)

    def _unavailable(self) -> RouterUnavailable:
        return RouterUnavailable(
            f"router at {self.endpoint} did not answer within {self.timeout_s:g}s "
            "(gateway.route_timeout_s)"
        )

    async def _ask(self, make: type, reply_type: type[R], **fields: object) -> R:
        assert self._loop is not None, "RoutingClient.start() was not awaited"
        request_id = next(self._ids)
        future: asyncio.Future[p.RoutingReply] = self._loop.create_future()
        payload = self._encode(make(request_id=request_id, **fields))
        resend = payload if make in _RESENDABLE else b""
        self._pending[request_id] = (future, self._loop.time() + self.timeout_s, resend)
        self._send(request_id, payload)
        if self._expiry is None:
            self._arm_expiry()
        try:
            reply = await future
        finally:
            self._pending.pop(request_id, None)
        assert isinstance(reply, reply_type)
        return reply

    # --- requests -------------------------------------------------------------------
    async def route(
        self,
        model: str,
        *,
        priority: str = "interactive",
        exclude: list[str] | None = None,
        **hints: Any,
    ) -> p.RouteReply:
        """`hints`: Route's prefix-routing fields (contracts/prompt_tokens.py RouteHints).
        While the router is away, routes on the last replica set it listed (ReplicaView)."""
        assert self._loop is not None, "RoutingClient.start() was not awaited"
        give_up_at = self._loop.time() + self.adapter_wait_s
        while True:
            if self.view.router_away and (fallback := self.view.pick(model, exclude or ())):
                _count(self._undeclared, (fallback.replica_id, model))
                return fallback
            if exclude:
                hints["exclude"] = exclude
            if self._released:
                hints["released"], hints["released_models"] = self._take_released()
            try:
                reply = await self._ask(
                    p.Route, p.RouteReply, model=model, priority=priority, **hints
                )
            except RouterUnavailable as err:
                self.view.router_lost(str(err))
                fallback = self.view.pick(model, exclude or ())
                if fallback is None:
                    raise
                _count(self._undeclared, (fallback.replica_id, model))
                return fallback
            hints.pop("released", None)
            hints.pop("released_models", None)
            if reply.replica_id:
                if reply.epoch != self.epoch:
                    self._see_epoch(reply.epoch)
                _count(self._declared, (reply.replica_id, model))
            # The router is loading the LoRA adapter `model` names, or has just started and
            # the engines are re-registering: route on the last replica list if it has one,
            # else ask again shortly.
            if reply.error == p.ROUTER_STARTING and (
                fallback := self.view.pick(model, exclude or ())
            ):
                _count(self._undeclared, (fallback.replica_id, model))
                return fallback
            waiting = reply.error in ("adapter_loading", p.ROUTER_STARTING)
            if not waiting or self._loop.time() >= give_up_at:
                return reply
            await asyncio.sleep(0.05)

    async def sync_quota(self, gateway_id: str, usage: list[p.TenantUsage]) -> p.QuotaTotals:
        return await self._ask(p.QuotaReport, p.QuotaTotals, gateway_id=gateway_id, usage=usage)

    async def models(self) -> p.ModelList:
        return await self._ask(p.ListModels, p.ModelList)

    async def replicas(self) -> p.ReplicaList:
        return await self._ask(p.ListReplicas, p.ReplicaList)

    def release(self, replica_id: str, model: str = "") -> None:
        """Count a routed request finished: folded into the next Route (one message instead
        of two per request), or sent alone after `RELEASE_DELAY_S` when no Route comes.
        `model`: what the request asked for (the router counts LoRA adapters in flight)."""
        if self._dealer is None:
            return
        self.view.released(replica_id)
        key = (replica_id, model)
        if _uncount(self._undeclared, key):
            return  # the router never counted it
        _uncount(self._declared, key)
        self._release_soon(replica_id, model)

    def _release_soon(self, replica_id: str, model: str) -> None:
        self._released.append(replica_id)
        self._released_models.append(model)
        if self._release_timer is None:
            assert self._loop is not None
            self._release_timer = self._loop.call_later(RELEASE_DELAY_S, self._send_releases)

    def _take_released(self) -> tuple[list[str], list[str]]:
        released, self._released = self._released, []
        models, self._released_models = self._released_models, []
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        return released, models

    def _send_releases(self) -> None:
        """Pending Releases as frames of the next message (fire and forget)."""
        self._release_timer = None
        released, self._released = self._released, []
        models, self._released_models = self._released_models, []
        if self._dealer is None or not released:
            return
        self._outbox.extend(
            (0, self._encode(p.Release(replica_id, model)))
            for replica_id, model in zip(released, models, strict=True)
        )
        if not self._flush_soon:
            self._flush_soon = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)


def _count(counts: dict[tuple[str, str], int], key: tuple[str, str]) -> None:
    counts[key] = counts.get(key, 0) + 1


def _uncount(counts: dict[tuple[str, str], int], key: tuple[str, str]) -> bool:
    count = counts.get(key)
    if count is None:
        return False
    if count <= 1:
        del counts[key]
    else:
        counts[key] = count - 1
    return True
