"""A ZeroMQ DEALER that lives in the asyncio event loop: ZMTP 3.0, NULL mechanism.

The router binds a real libzmq ROUTER (router/server.py); the gateway's side of that
conversation speaks ZeroMQ's wire protocol (https://rfc.zeromq.org/spec/23/) over a plain
asyncio connection instead of a libzmq socket. Why: a libzmq socket hands every message to
its own I/O thread and back, two thread wake-ups per message on each side, which on the
gateway's one core cost more than the routing decision itself (bench/router_roundtrip.py
measures both). Here a send is one write() on the loop's transport and a reply arrives with
the loop's own poll, like any HTTP connection.

What it speaks: the 64-byte greeting (version 3.0, NULL, client), a READY command with
Socket-Type DEALER, then messages as frames (MORE flag, 1- or 8-byte sizes). Commands the
peer sends after READY (ERROR, PING) are read and ignored; an ERROR closes the connection.
Only `tcp://host:port` and `ipc://path` endpoints; the connection is retried every
`reconnect_s` while it is down (libzmq's default interval).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
from collections.abc import Callable

log = logging.getLogger(__name__)

GREETING = (
    b"\xff" + b"\x00" * 8 + b"\x7f"  # signature
    + b"\x03\x00"  # version 3.0
    + b"NULL".ljust(20, b"\x00")  # mechanism
    + b"\x00"  # as-server: no
    + b"\x00" * 31  # filler
)  # fmt: skip
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def _command(name: bytes, properties: dict[bytes, bytes]) -> bytes:
    body = bytes([len(name)]) + name
    for key, value in properties.items():
        body += bytes([len(key)]) + key + struct.pack(">I", len(value)) + value
    return _frame(body, _COMMAND)


def _frame(body: bytes, flags: int) -> bytes:
    size = len(body)
    if size < 256:
        return bytes((flags, size)) + body
    return bytes((flags | _LONG,)) + size.to_bytes(8, "big") + body


READY = _command(b"READY", {b"Socket-Type": b"DEALER"})


def encode_message(frames: list[bytes]) -> bytes:
    """One message of one or more frames, as ZMTP puts it on the wire."""
    last = len(frames) - 1
    return b"".join(_frame(f, _MORE if i < last else 0) for i, f in enumerate(frames))


def parse_endpoint(endpoint: str) -> tuple[str, str, int]:
    """("tcp", host, port) or ("ipc", path, 0); ValueError names what is wrong."""
    if endpoint.startswith("ipc://"):
        return "ipc", endpoint[len("ipc://") :], 0
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if sep and host and port.isdigit() and host != "*":
            return "tcp", host.strip("[]"), int(port)
    raise ValueError(
        f"routing endpoint {endpoint!r}: expected tcp://host:port or ipc://path "
        "(gateway.routing_endpoint)"
    )


def _same(conn: _Connection) -> _Connection:
    return conn


class _Connection(asyncio.Protocol):
    def __init__(self, owner: ZmtpDealer) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.greeted = False
        self.ready = False
        self.frames: list[bytes] = []
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.owner._conn = self
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(GREETING + READY)

    def connection_lost(self, exc: Exception | None) -> None:
        was_ready, self.ready = self.ready, False
        if not self.lost.done():
            self.lost.set_result(None)
        self.owner._lost(self, was_ready)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.greeted:
            if len(buffer) < 64:
                return
            if buffer[0] != 0xFF or buffer[9] != 0x7F or buffer[10] < 3:
                self._fail(f"not a ZMTP 3 peer (greeting {bytes(buffer[:11])!r})")
                return
            del buffer[:64]
            self.greeted = True
        pos, end = 0, len(buffer)
        while end - pos >= 2:
            flags = buffer[pos]
            if flags & _LONG:
                if end - pos < 9:
                    break
                size = int.from_bytes(buffer[pos + 1 : pos + 9], "big")
                start = pos + 9
            else:
                size = buffer[pos + 1]
                start = pos + 2
            if end - start < size:
                break
            body = bytes(buffer[start : start + size])
            pos = start + size
            if flags & _COMMAND:
                self._on_command(body)
                continue
            self.frames.append(body)
            if not flags & _MORE:
                frames, self.frames = self.frames, []
                self.owner.on_message(frames)
        del buffer[:pos]

    def _on_command(self, body: bytes) -> None:
        name = body[1 : 1 + body[0]] if body else b""
        if name == b"READY" and not self.ready:
            self.ready = True
            self.owner._ready(self)
        elif name == b"ERROR":
            self._fail(f"peer sent ERROR: {body[1 + body[0] :]!r}")

    def _fail(self, why: str) -> None:
        log.warning("ZMTP connection to %s closed: %s", self.owner.endpoint, why)
        if self.transport is not None:
            self.transport.close()


class ZmtpDealer:
    """`send` a message (list of frames) while `connected`; each message received goes to
    `on_message`; `on_connected` is called each time a connection becomes ready."""

    def __init__(
        self,
        endpoint: str,
        on_message: Callable[[list[bytes]], None],
        on_connected: Callable[[], None] = lambda: None,
        *,
        reconnect_s: float = 0.1,
    ) -> None:
        self.endpoint = endpoint
        self._kind, self._host, self._port = parse_endpoint(endpoint)
        self.on_message = on_message
        self.on_connected = on_connected
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
        conn.transport.write(encode_message(frames))
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
            log.info("routing connection to %s ready", self.endpoint)
            self.on_connected()

    def _lost(self, conn: _Connection, was_ready: bool) -> None:
        if was_ready and not self._closing:
            log.warning("routing connection to %s lost; reconnecting", self.endpoint)
