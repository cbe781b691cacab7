"""The gateway's side of the routing conversation with the router.

One DEALER socket per gateway process, owned by one reader task that matches
replies to waiting requests by request id. Every wait has a deadline
(`gateway.route_timeout_s`): a router that does not answer costs a 503, never a
hung request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from hpcserve.gateway.replica_view import ReplicaView
from hpcserve.router import protocol as p

log = logging.getLogger(__name__)

R = TypeVar("R", bound=p.RoutingReply)
# A Release waits at most this long for a Route to ride on.
RELEASE_DELAY_S = 0.002


class RouterUnavailable(Exception):
    pass


class RoutingClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        adapter_wait_s: float = 60.0,
        view_refresh_s: float = 2.0,
        view_max_age_s: float = 300.0,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        # The last known replica set, routed on while the router is away.
        self.view = ReplicaView(view_max_age_s, clock=time.monotonic)
        self.view_refresh_s = view_refresh_s
        self._viewer: asyncio.Task[None] | None = None
        # A LoRA adapter loaded on demand (router/adapters.py): how long a request waits.
        self.adapter_wait_s = adapter_wait_s
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[p.RoutingReply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._released: list[str] = []
        self._flush: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Requests queued for a router that is down would be answered late or never: drop them.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.endpoint)
        self._sock = sock
        self._reader = asyncio.create_task(self._read_replies(), name="routing-client-reader")
        self._viewer = asyncio.create_task(self._refresh_view(), name="routing-client-view")
        log.info("routing client connected to %s", self.endpoint)

    async def _refresh_view(self) -> None:
        while True:
            try:
                self.view.update((await self.replicas()).replicas)
            except RouterUnavailable as err:
                self.view.router_lost(str(err))
            await asyncio.sleep(self.view_refresh_s)

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._send_releases()
        for task in (self._viewer, self._reader):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(0)
        self._ctx.term()

    async def _read_replies(self) -> None:
        assert self._sock is not None
        while True:
            payload = await self._sock.recv()
            try:
                reply = p.routing_reply_decoder.decode(payload)
            except msgspec.DecodeError as err:
                log.warning("undecodable reply from router dropped: %s", err)
                continue
            future = self._pending.pop(reply.request_id, None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def _ask(self, make: type, reply_type: type[R], **fields: object) -> R:
        assert self._sock is not None, "RoutingClient.start() was not awaited"
        request_id = next(self._ids)
        future: asyncio.Future[p.RoutingReply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with asyncio.timeout(self.timeout_s):
                # IMMEDIATE is set: while no router is connected this waits, up to the deadline.
                await self._sock.send(p.encode(make(request_id=request_id, **fields)))
                reply = await future
        except TimeoutError:
            raise RouterUnavailable(
                f"router at {self.endpoint} did not answer within {self.timeout_s:g}s "
                "(gateway.route_timeout_s)"
            ) from None
        finally:
            self._pending.pop(request_id, None)
        assert isinstance(reply, reply_type)
        return reply

    async def route(
        self,
        model: str,
        *,
        priority: str = "interactive",
        exclude: list[str] | None = None,
        **hints: Any,
    ) -> p.RouteReply:
        """`hints`: Route's prefix-routing fields (router/prompt_tokens.py RouteHints).
        While the router is away, routes on the last replica set it listed (ReplicaView)."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.adapter_wait_s
        while True:
            if self.view.router_away and (fallback := self.view.pick(model, exclude or ())):
                return fallback
            if exclude:
                hints["exclude"] = exclude
            if self._released:
                hints["released"] = self._take_released()
            try:
                reply = await self._ask(
                    p.Route, p.RouteReply, model=model, priority=priority, **hints
                )
            except RouterUnavailable as err:
                self.view.router_lost(str(err))
                fallback = self.view.pick(model, exclude or ())
                if fallback is None:
                    raise
                return fallback
            hints.pop("released", None)
            # The router is loading the LoRA adapter `model` names: ask again shortly.
            if reply.error != "adapter_loading" or loop.time() >= give_up_at:
                return reply
            await asyncio.sleep(0.05)

    async def sync_quota(self, gateway_id: str, usage: list[p.TenantUsage]) -> p.QuotaTotals:
        return await self._ask(p.QuotaReport, p.QuotaTotals, gateway_id=gateway_id, usage=usage)

    async def models(self) -> p.ModelList:
        return await self._ask(p.ListModels, p.ModelList)

    async def replicas(self) -> p.ReplicaList:
        return await self._ask(p.ListReplicas, p.ReplicaList)

    def release(self, replica_id: str) -> None:
        """Count a routed request finished: folded into the next Route (one send instead of
        two per request), or sent alone after `RELEASE_DELAY_S` when no Route comes."""
        if self._sock is None:
            return
        self.view.released(replica_id)
        self._released.append(replica_id)
        if self._flush is None:
            loop = asyncio.get_running_loop()
            self._flush = loop.call_later(RELEASE_DELAY_S, self._send_releases)

    def _take_released(self) -> list[str]:
        released, self._released = self._released, []
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        return released

    def _send_releases(self) -> None:
        self._flush = None
        released, self._released = self._released, []
        if self._sock is None or not released:
            return
        for replica_id in released:
            sent = self._sock.send(p.encode(p.Release(replica_id)), flags=zmq.NOBLOCK)
            sent.add_done_callback(_log_dropped_release)


def _log_dropped_release(sent: asyncio.Future[object]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.debug("release dropped: %s", sent.exception())
