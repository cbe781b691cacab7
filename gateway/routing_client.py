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
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from hpcserve.router import protocol as p

log = logging.getLogger(__name__)

R = TypeVar("R", bound=p.RoutingReply)


class RouterUnavailable(Exception):
    pass


class RoutingClient:
    def __init__(self, endpoint: str, *, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[p.RoutingReply]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Requests queued for a router that is down would be answered late or never: drop them.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.endpoint)
        self._sock = sock
        self._reader = asyncio.create_task(self._read_replies(), name="routing-client-reader")
        log.info("routing client connected to %s", self.endpoint)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
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

    async def route(self, model: str) -> p.RouteReply:
        return await self._ask(p.Route, p.RouteReply, model=model)

    async def models(self) -> p.ModelList:
        return await self._ask(p.ListModels, p.ModelList)

    async def replicas(self) -> p.ReplicaList:
        return await self._ask(p.ListReplicas, p.ReplicaList)

    def release(self, replica_id: str) -> None:
        if self._sock is None:
            return
        sent = self._sock.send(p.encode(p.Release(replica_id)), flags=zmq.NOBLOCK)
        sent.add_done_callback(_log_dropped_release)


def _log_dropped_release(sent: asyncio.Future[object]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.debug("release dropped: %s", sent.exception())
