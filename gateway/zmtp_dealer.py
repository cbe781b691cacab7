"""A ZeroMQ DEALER that lives in the asyncio event loop: ZMTP 3.0, NULL or CURVE mechanism.

The gateway's side of the routing conversation (contracts/zmtp.py has the wire format, shared
with the router's side, and why neither uses libzmq): a send is one write() on the loop's
transport and a reply arrives with the loop's own poll, like any HTTP connection. The
connection is retried every `reconnect_s` while it is down (libzmq's default interval).
With `curve` keys (contracts/zmtp_curve.py) it speaks CURVE: the connection is ready once
the router has admitted our key, and every message is encrypted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from hpcserve.contracts.zmtp import (
    GREETING,
    ZmtpError,
    ZmtpParser,
    command_name,
    encode_message,
    keepalive,
    parse_endpoint,
    ready,
)

if TYPE_CHECKING:
    from hpcserve.contracts.zmtp_curve import ClientKeys, CurveClient

log = logging.getLogger(__name__)

READY = ready(b"DEALER")
__all__ = ["ZmtpDealer", "encode_message", "parse_endpoint"]


def _same(conn: _Connection) -> _Connection:
    return conn


def _connected_to_itself(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False


class _Connection(asyncio.Protocol):
    def __init__(self, owner: ZmtpDealer) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.parser: ZmtpParser | CurveClient
        self.encode: Callable[[list[bytes]], bytes] = encode_message
        self.curve: CurveClient | None = None
        if owner.curve is None:
            self.parser = ZmtpParser(self._on_command, owner.on_message)
        else:
            self.curve = owner.curve.client(self._write, owner.on_message, self._curve_ready)
            self.parser, self.encode = self.curve, self.curve.encode
        self.ready = False
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            if _connected_to_itself(sock):
                # No router listens on the port, and the kernel picked that same port as
                # this side's own: TCP joins the socket to itself, and our own greeting and
                # READY would answer us. Every Route would then go unanswered.
                log.warning(
                    "routing connection to %s reached itself; retrying", self.owner.endpoint
                )
                cast(asyncio.Transport, transport).abort()
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keepalive(sock)  # a router host gone without a word: reconnect, not wait
        self.owner._conn = self
        cast(asyncio.Transport, transport).write(
            GREETING + READY if self.curve is None else self.curve.start()
        )

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _curve_ready(self) -> None:
        if not self.ready:
            self.ready = True
            self.owner._ready(self)

    def connection_lost(self, exc: Exception | None) -> None:
        was_ready, self.ready = self.ready, False
        if not self.lost.done():
            self.lost.set_result(None)
        self.owner._lost(self, was_ready)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
        except ZmtpError as err:
            self._fail(str(err))

    def _on_command(self, body: bytes) -> None:
        name = command_name(body)
        if name == b"READY" and not self.ready:
            self.ready = True
            self.owner._ready(self)
        elif name == b"ERROR":
            raise ZmtpError(f"peer sent ERROR: {body[1 + body[0] :]!r}")

    def _fail(self, why: str) -> None:
        if why != self.owner._last_failure:  # once per cause, not once per retry
            self.owner._last_failure = why
            log.warning("ZMTP connection to %s closed: %s", self.owner.endpoint, why)
        if self.transport is not None:
            self.transport.close()


class ZmtpDealer:
    """`send` a message (list of frames) while `connected`; each message received goes to
    `on_message`; `on_connected` is called each time a connection becomes ready, `on_lost`
    each time a ready one is lost (what was sent on it may not have arrived)."""

    def __init__(
        self,
        endpoint: str,
        on_message: Callable[[list[bytes]], None],
        on_connected: Callable[[], None] = lambda: None,
        *,
        reconnect_s: float = 0.1,
        on_lost: Callable[[], None] = lambda: None,
        curve: ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self._last_failure = ""
        self._kind, self._host, self._port = parse_endpoint(endpoint)
        self.on_message = on_message
        self.on_connected = on_connected
        self.on_lost = on_lost
        self.reconnect_s = reconnect_s
        self._closing = False
        self._conn: _Connection | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.ready

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_connected(), name="zmtp-dealer")

    def send(self, frames: list[bytes]) -> bool:
        conn = self._conn
        if conn is None or not conn.ready or conn.transport is None:
            return False
        conn.transport.write(conn.encode(frames))
        return True

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn = _Connection(self)
            try:
                if self._kind == "ipc":
                    await loop.create_unix_connection(functools.partial(_same, conn), self._host)
                else:
                    await loop.create_connection(
                        functools.partial(_same, conn), self._host, self._port
                    )
            except OSError as err:
                log.debug("routing connection to %s failed: %s", self.endpoint, err)
                await asyncio.sleep(self.reconnect_s)
                continue
            await conn.lost
            if self._conn is conn:
                self._conn = None
            await asyncio.sleep(self.reconnect_s)

    def _ready(self, conn: _Connection) -> None:
        if conn is self._conn:
            self._last_failure = ""
            log.info(
                "routing connection to %s ready%s",
                self.endpoint,
                " (CURVE)" if self.curve is not None else "",
            )
            self.on_connected()

    def _lost(self, conn: _Connection, was_ready: bool) -> None:
        if was_ready and not self._closing:
            log.warning("routing connection to %s lost; reconnecting", self.endpoint)
        if was_ready:
            self.on_lost()
