"""ZeroMQ's wire protocol, ZMTP 3.0 with the NULL or CURVE mechanism, without libzmq.

The routing conversation between gateways and the router is spoken on plain sockets in the
processes' own loops: the gateway's DEALER on its asyncio loop (gateway/zmtp_dealer.py), the
router's ROUTER in its poll loop (`ZmtpRouter` below). Why: a libzmq socket hands every
message to its I/O thread and back, thread wake-ups that cost more than the routing decision
on these machines (bench/router_roundtrip.py measures both). Either side still talks to a
real libzmq peer (the CLI's one-shot queries, contracts/router_client.py, are libzmq DEALERs).

What is spoken (https://rfc.zeromq.org/spec/23/): the 64-byte greeting (version 3.0, NULL),
a READY command with the Socket-Type, then messages as frames (MORE flag, 1- or 8-byte
sizes). Commands after READY other than ERROR (e.g. PING, which libzmq sends only when
heartbeats are configured) are read and ignored; ERROR, a greeting that is not ZMTP 3 with
the mechanism this side speaks, or a frame over MAX_FRAME closes the connection. Endpoints:
`tcp://host:port` and `ipc://path`. With keys, both sides speak CURVE instead of NULL
(contracts/zmtp_curve.py: authenticated and encrypted; the router admits only the gateway
keys it holds), and a peer that speaks the other mechanism is disconnected.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import zmq

if TYPE_CHECKING:
    from hpcserve.contracts.zmtp_curve import CurveServer, ServerKeys

log = logging.getLogger(__name__)


def greeting(mechanism: bytes = b"NULL", *, as_server: bool = False) -> bytes:
    return (
        b"\xff" + b"\x00" * 8 + b"\x7f"  # signature
        + b"\x03\x00"  # version 3.0
        + mechanism.ljust(20, b"\x00")  # mechanism
        + (b"\x01" if as_server else b"\x00")  # as-server: unused by NULL
        + b"\x00" * 31  # filler
    )  # fmt: skip


GREETING = greeting()
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
# A frame larger than this is refused (the connection closed) rather than buffered: routing
# messages are kilobytes, so a size like this is a broken or hostile peer.
MAX_FRAME = 64 << 20
# A routing connection silent this long (TCP keepalive: 10 s idle, 3 probes 5 s apart), or
# with what it sent unacknowledged this long (TCP_USER_TIMEOUT), is dropped: a peer gone
# without closing it.
KEEPALIVE_S = 25


class ZmtpError(Exception):
    """The peer does not speak what we speak: the connection is closed."""


def frame(body: bytes, flags: int) -> bytes:
    size = len(body)
    if size < 256:
        return bytes((flags, size)) + body
    return bytes((flags | _LONG,)) + size.to_bytes(8, "big") + body


def command(name: bytes, properties: dict[bytes, bytes]) -> bytes:
    body = bytes([len(name)]) + name
    for key, value in properties.items():
        body += bytes([len(key)]) + key + struct.pack(">I", len(value)) + value
    return frame(body, _COMMAND)


def ready(socket_type: bytes) -> bytes:
    return command(b"READY", {b"Socket-Type": socket_type})


def encode_message(frames: list[bytes]) -> bytes:
    """One message of one or more frames, as ZMTP puts it on the wire."""
    last = len(frames) - 1
    return b"".join(frame(f, _MORE if i < last else 0) for i, f in enumerate(frames))


def parse_endpoint(
    endpoint: str, setting: str = "gateway.routing_endpoint", *, bind: bool = False
) -> tuple[str, str, int]:
    """("tcp", host, port) or ("ipc", path, 0); ValueError names the setting and what is
    wrong. A bind endpoint may say `tcp://*:port` (every IPv4 interface: host "0.0.0.0")."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return "ipc", endpoint[len("ipc://") :], 0
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if bind and host == "*":
            host = "0.0.0.0"
        if sep and host and port.isdigit() and host != "*":
            return "tcp", host.strip("[]"), int(port)
    raise ValueError(
        f"routing endpoint {endpoint!r}: expected tcp://host:port or ipc://path ({setting})"
    )


class ZmtpParser:
    """Bytes in (`feed`), the peer's greeting checked, then each command body to
    `on_command` and each whole message (its frames) to `on_message`."""

    __slots__ = ("buffer", "frames", "greeted", "mechanism", "on_command", "on_message")

    def __init__(
        self,
        on_command: Callable[[bytes], None],
        on_message: Callable[[list[bytes]], None],
        *,
        mechanism: bytes = b"NULL",
    ) -> None:
        self.on_command = on_command
        self.on_message = on_message
        self.mechanism = mechanism
        self.buffer = bytearray()
        self.greeted = False
        self.frames: list[bytes] = []

    def feed(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.greeted:
            if len(buffer) < 64:
                return
            if buffer[0] != 0xFF or buffer[9] != 0x7F or buffer[10] < 3:
                raise ZmtpError(f"not a ZMTP 3 peer (greeting {bytes(buffer[:11])!r})")
            theirs = bytes(buffer[12:32]).rstrip(b"\x00")
            if theirs != self.mechanism:
                raise ZmtpError(
                    f"the peer speaks mechanism {theirs.decode(errors='replace')}, this side "
                    f"{self.mechanism.decode()}"
                    + (": it holds no key" if theirs == b"NULL" else ": keys on one side only")
                )
            del buffer[:64]
            self.greeted = True
        pos, end = 0, len(buffer)
        while end - pos >= 2:
            flags = buffer[pos]
            if flags & _LONG:
                if end - pos < 9:
                    break
                size = int.from_bytes(buffer[pos + 1 : pos + 9], "big")
                if size > MAX_FRAME:
                    raise ZmtpError(f"a frame of {size} bytes (more than {MAX_FRAME})")
                start = pos + 9
            else:
                size = buffer[pos + 1]
                start = pos + 2
            if end - start < size:
                break
            body = bytes(buffer[start : start + size])
            pos = start + size
            if flags & _COMMAND:
                self.on_command(body)
                continue
            self.frames.append(body)
            if not flags & _MORE:
                frames, self.frames = self.frames, []
                self.on_message(frames)
        del buffer[:pos]


def command_name(body: bytes) -> bytes:
    return body[1 : 1 + body[0]] if body else b""


class _Peer:
    __slots__ = ("encode", "id", "inbox", "out", "parser", "ready", "sock")

    def __init__(self, peer_id: bytes, sock: socket.socket) -> None:
        self.id = peer_id
        self.sock = sock
        self.ready = False
        self.out = bytearray()  # what the kernel did not take yet
        self.inbox: list[list[bytes]] = []
        self.parser: ZmtpParser | CurveServer = ZmtpParser(self._on_command, self.inbox.append)
        self.encode: Callable[[list[bytes]], bytes] = encode_message

    def set_ready(self) -> None:
        self.ready = True

    def _on_command(self, body: bytes) -> None:
        name = command_name(body)
        if name == b"READY":
            self.ready = True
        elif name == b"ERROR":
            raise ZmtpError(f"peer sent ERROR: {body[1 + body[0] :]!r}")


class ZmtpRouter:
    """A ZeroMQ ROUTER served from the owner's zmq.Poller loop, on plain non-blocking sockets.

    With `curve` (contracts/zmtp_curve.py) every connection speaks CURVE: a peer is
    admitted (`ready`) only after a handshake proving it holds one of the allowed client
    keys; until then nothing it sends is read as a message, and a failed handshake
    disconnects it (`refused` counts connections gone before their handshake ended).

    `bind()` listens and registers with `poller`; after each poll, `receive(events)` accepts
    new peers, reads what arrived and yields (peer id, frames) per message; `send(peer, frames)`
    writes at once (what the kernel does not take waits for POLLOUT, up to `max_buffered`
    bytes per peer; beyond that a message is dropped, as libzmq's ROUTER drops at its high
    water mark). A peer that sends what is not ZMTP is disconnected and logged. `on_drop`
    is told each peer id whose connection is gone (closed, reset, dropped, or silent past
    TCP keepalive: KEEPALIVE_S).
    """

    def __init__(
        self,
        endpoint: str,
        poller: zmq.Poller,
        *,
        max_buffered: int = 64 << 20,
        on_drop: Callable[[bytes], None] | None = None,
        curve: ServerKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.on_drop = on_drop
        self.curve = curve
        self.refused = 0  # connections whose CURVE handshake failed
        self._kind, self._host, self._port = parse_endpoint(
            endpoint, "router.routing_bind", bind=True
        )
        self._poller = poller
        self.max_buffered = max_buffered
        self._listener: socket.socket | None = None
        self._peers: dict[int, _Peer] = {}  # by fd
        self._by_id: dict[bytes, _Peer] = {}
        self._ids = itertools.count(1)
        self._hello = GREETING + ready(b"ROUTER")

    def bind(self) -> None:
        """Listen on the endpoint; RuntimeError names it when that fails."""
        try:
            if self._kind == "ipc":
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                if os.path.exists(self._host):
                    os.unlink(self._host)  # a stale socket file, as libzmq does
                address: str | tuple[Any, ...] = self._host
            else:
                family, _, _, _, address = socket.getaddrinfo(
                    self._host, self._port, type=socket.SOCK_STREAM
                )[0]
                listener = socket.socket(family, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(address)
                listener.listen(256)
            except OSError:
                listener.close()
                raise
        except OSError as err:
            raise RuntimeError(f"router cannot bind {self.endpoint}: {err}") from None
        listener.setblocking(False)
        self._listener = listener
        self._poller.register(listener.fileno(), zmq.POLLIN)

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)
        if self._listener is not None:
            self._poller.unregister(self._listener.fileno())
            self._listener.close()
            self._listener = None
            if self._kind == "ipc" and os.path.exists(self._host):
                os.unlink(self._host)

    def receive(self, events: dict[int, int]) -> Iterator[tuple[bytes, list[bytes]]]:
        """The messages that arrived, per the poll's `events` (fd -> flags). Nothing more of
        a peer once it is dropped (at EOF after its last bytes, or as a reply to it fails):
        its replies could not be sent, and `on_drop` has already settled its account."""
        if self._listener is not None and self._listener.fileno() in events:
            self._accept()
        by_id = self._by_id
        for fd, flags in events.items():
            peer = self._peers.get(fd)
            if peer is None:
                continue
            if flags & zmq.POLLOUT:
                self._flush(peer)
                if peer.id not in by_id:
                    continue
            if flags & (zmq.POLLIN | zmq.POLLERR):
                self._read(peer)
                inbox = peer.inbox[:]
                peer.inbox.clear()
                for frames in inbox:
                    if peer.id not in by_id:
                        break
                    yield peer.id, frames

    def send(self, peer_id: bytes, frames: list[bytes]) -> bool:
        """False when the peer is gone or too far behind (the message is dropped)."""
        peer = self._by_id.get(peer_id)
        if peer is None or not peer.ready:
            return False
        return self._write(peer, peer.encode(frames))

    def _write(self, peer: _Peer, data: bytes) -> bool:
        if peer.out:
            if len(peer.out) + len(data) > self.max_buffered:
                return False
            peer.out += data
            return True
        try:
            sent = peer.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as err:
            self._drop(peer, f"send failed: {err}")
            return False
        if sent < len(data):
            peer.out += data[sent:]
            self._poller.modify(peer.sock.fileno(), zmq.POLLIN | zmq.POLLOUT)
        return True

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:  # e.g. EMFILE: the peer retries
                log.warning("routing socket: accept failed: %s", err)
                return
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keepalive(sock)
            peer = _Peer(next(self._ids).to_bytes(4, "big"), sock)
            hello = self._hello
            if self.curve is not None:
                # The handshake's WELCOME, READY or ERROR go out as they are made.
                write = functools.partial(self._write, peer)
                session = self.curve.server(write, peer.inbox.append, peer.set_ready)
                peer.parser, peer.encode = session, session.encode
                hello = session.start()
            self._peers[sock.fileno()] = peer
            self._by_id[peer.id] = peer
            self._poller.register(sock.fileno(), zmq.POLLIN)
            try:
                sock.send(hello)  # fits an empty socket buffer
            except OSError as err:
                self._drop(peer, f"greeting failed: {err}")

    def _read(self, peer: _Peer) -> None:
        """Read what is there into the peer's inbox; drop the peer at EOF or on bad input."""
        while True:
            try:
                data = peer.sock.recv(262144)
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno != errno.ECONNRESET:
                    log.warning("routing socket: peer %s: %s", peer.id.hex(), err)
                self._drop(peer)
                return
            if not data:
                self._drop(peer)
                return
            try:
                peer.parser.feed(data)
            except ZmtpError as err:
                self._drop(peer, str(err))
                return
            if peer.id not in self._by_id:
                return  # a handshake reply could not be sent
            if len(data) < 262144:
                return

    def _flush(self, peer: _Peer) -> None:
        try:
            sent = peer.sock.send(peer.out)
        except BlockingIOError:
            return
        except OSError as err:
            self._drop(peer, f"send failed: {err}")
            return
        del peer.out[:sent]
        if not peer.out:
            self._poller.modify(peer.sock.fileno(), zmq.POLLIN)

    def _drop(self, peer: _Peer, why: str = "") -> None:
        if why:
            log.warning("routing socket: peer %s disconnected: %s", peer.id.hex(), why)
        fd = peer.sock.fileno()
        if self._peers.pop(fd, None) is not None:
            self._poller.unregister(fd)
        gone = self._by_id.pop(peer.id, None) is not None
        if gone and self.curve is not None and not peer.ready:
            self.refused += 1  # it never completed the handshake (no key, or a wrong one)
        peer.sock.close()
        if gone and self.on_drop is not None:
            self.on_drop(peer.id)


def keepalive(sock: socket.socket) -> None:
    """A peer that vanished without closing (host down, network partition) is noticed
    within about KEEPALIVE_S (idle, then probes), not hours later."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = {
        "TCP_KEEPIDLE": 10,
        "TCP_KEEPINTVL": 5,
        "TCP_KEEPCNT": 3,
        "TCP_USER_TIMEOUT": KEEPALIVE_S * 1000,  # ms; else retransmissions last ~15 min
    }
    for option, value in options.items():
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
