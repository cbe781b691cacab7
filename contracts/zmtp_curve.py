"""CurveZMQ on our own ZMTP connections: the routing socket's authentication and encryption.

The routing socket is spoken without libzmq (contracts/zmtp.py), so its CURVE mechanism is
here: ZMTP-CURVE (https://rfc.zeromq.org/spec/25/) over CurveZMQ
(https://rfc.zeromq.org/spec/26/), with libsodium's crypto_box through PyNaCl, byte for byte
what libzmq sends, so either side still talks to a libzmq peer (the CLI's one-shot queries
are libzmq DEALERs with CURVE options; a test checks both directions against libzmq).

The handshake: the client (the gateway's DEALER) sends HELLO (its short-term key C', a box
only the server's long-term key S opens), the server answers WELCOME (its short-term key
S' and a cookie only it can open), the client sends INITIATE (the cookie, its long-term key
C and a vouch binding C to C', boxed for S'), the server checks the vouch, admits C only if
it is one of the allowed client keys, and answers READY; else ERROR and the connection is
closed. Every message after that is one MESSAGE command per frame, boxed with the
short-term keys and a strictly increasing nonce (a replayed or reordered box is refused).

`CurveClient` and `CurveServer` are the two ends of one connection. Each takes the bytes
that arrive (`feed`), writes what the handshake needs through its `write` callback, hands
each whole decrypted message (list of frames) to `on_message`, calls `on_ready` once the
handshake is done, and encodes outgoing messages with `encode`. Bad input raises ZmtpError:
the owner closes the connection.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq.auth
from nacl import bindings as nacl
from nacl.exceptions import CryptoError
from zmq.utils import z85

from hpcserve.contracts.private_files import tighten
from hpcserve.contracts.zmtp import (
    ZmtpError,
    ZmtpParser,
    command_name,
    frame,
    greeting,
)

_COMMAND = 0x04
_MORE = 0x01
_HELLO_NONCE = b"CurveZMQHELLO---"
_INITIATE_NONCE = b"CurveZMQINITIATE"
_READY_NONCE = b"CurveZMQREADY---"
_CLIENT_MESSAGE = b"CurveZMQMESSAGEC"
_SERVER_MESSAGE = b"CurveZMQMESSAGES"
_MESSAGE = b"\x07MESSAGE"
_pack_nonce = struct.Struct(">Q").pack


def load_public_key(path: Path) -> bytes:
    """The 32-byte public key of a ZeroMQ certificate file (`hpcserve keys` writes them)."""
    public, _ = zmq.auth.load_certificate(str(path))
    return z85.decode(public)


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret), 32 bytes each, from a ZeroMQ secret certificate file (made
    owner-only first if it was not: contracts/private_files.py)."""
    if Path(path).is_file():
        tighten(path)
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise CurveKeyError(f"{path} holds no secret key")
    return z85.decode(public), z85.decode(secret)


def load_allowed(directory: Path) -> frozenset[bytes]:
    """The public keys of the certificate files (*.key) in a directory."""
    return frozenset(load_public_key(p) for p in sorted(Path(directory).glob("*.key")))


# The routing socket's keys in the CURVE directory (`hpcserve keys`, contracts/curve.py):
# the router's keypair (as for registration), the gateways' keypair, and the directory of
# client keys the routing socket admits (not the engines': an engine cannot route).
ROUTER_SECRET = "router.key_secret"
ROUTER_PUBLIC = "router.key"
GATEWAY_SECRET = "gateway.key_secret"
GATEWAY_CLIENTS = "gateways"


class CurveKeyError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed: frozenset[bytes]

    def server(
        self,
        write: Callable[[bytes], object],
        on_message: Callable[[list[bytes]], None],
        on_ready: Callable[[], None],
    ) -> CurveServer:
        return CurveServer(self.public, self.secret, self.allowed, write=write,
                           on_message=on_message, on_ready=on_ready)  # fmt: skip


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    def client(
        self,
        write: Callable[[bytes], object],
        on_message: Callable[[list[bytes]], None],
        on_ready: Callable[[], None],
    ) -> CurveClient:
        return CurveClient(self.public, self.secret, self.server_public, write=write,
                           on_message=on_message, on_ready=on_ready)  # fmt: skip


def _need(path: Path) -> Path:
    if not path.exists():
        raise CurveKeyError(
            f"CURVE key {path} is missing (`hpcserve keys` adds the routing socket's keys "
            "to an existing key directory)"
        )
    return path


def routing_server_keys(curve_dir: str) -> ServerKeys | None:
    """The router's side of the routing socket; None without keys (plain)."""
    if not curve_dir:
        return None
    directory = Path(curve_dir)
    public, secret = load_keypair(_need(directory / ROUTER_SECRET))
    allowed = load_allowed(_need(directory / GATEWAY_CLIENTS))
    if not allowed:
        raise CurveKeyError(
            f"no gateway public keys in {directory / GATEWAY_CLIENTS} (run `hpcserve keys`)"
        )
    return ServerKeys(public, secret, allowed)


def routing_client_keys(curve_dir: str) -> ClientKeys | None:
    """A gateway's (or the CLI's) side of the routing socket; None without keys (plain)."""
    if not curve_dir:
        return None
    directory = Path(curve_dir)
    public, secret = load_keypair(_need(directory / GATEWAY_SECRET))
    return ClientKeys(public, secret, load_public_key(_need(directory / ROUTER_PUBLIC)))


def _properties(socket_type: bytes) -> bytes:
    out = b""
    props = {b"Socket-Type": socket_type}
    if socket_type in (b"DEALER", b"ROUTER", b"REQ"):
        props[b"Identity"] = b""
    for key, value in props.items():
        out += bytes([len(key)]) + key + struct.pack(">I", len(value)) + value
    return out


class _Session:
    """What both ends share once the handshake is done: the precomputed box key and the
    nonces of each direction."""

    __slots__ = (
        "_decode_prefix",
        "_encode_prefix",
        "_key",
        "_nonce",
        "_parser",
        "_partial",
        "_peer_nonce",
        "on_message",
        "on_ready",
        "ready",
        "write",
    )

    def __init__(
        self,
        write: Callable[[bytes], object],
        on_message: Callable[[list[bytes]], None],
        on_ready: Callable[[], None],
        encode_prefix: bytes,
        decode_prefix: bytes,
    ) -> None:
        self.write = write
        self.on_message = on_message
        self.on_ready = on_ready
        self.ready = False
        self._key = b""
        self._nonce = 1  # the next short nonce this side sends
        self._peer_nonce = 0  # the last short nonce the peer sent
        self._encode_prefix = encode_prefix
        self._decode_prefix = decode_prefix
        self._partial: list[bytes] = []
        self._parser = ZmtpParser(self._on_command, self._on_frames, mechanism=b"CURVE")

    def feed(self, data: bytes) -> None:
        self._parser.feed(data)

    def _next_nonce(self) -> bytes:
        nonce = _pack_nonce(self._nonce)
        self._nonce += 1
        return nonce

    def _peer_sent(self, short_nonce: bytes) -> None:
        value = int.from_bytes(short_nonce, "big")
        if value <= self._peer_nonce:
            raise ZmtpError("CURVE: a nonce that does not increase (a replayed message)")
        self._peer_nonce = value

    def encode(self, frames: Iterable[bytes]) -> bytes:
        """One message (its frames) as MESSAGE commands on the wire."""
        frames = list(frames)
        last = len(frames) - 1
        key, prefix, box = self._key, self._encode_prefix, nacl.crypto_box_afternm
        out = []
        for i, body in enumerate(frames):
            short = _pack_nonce(self._nonce)
            self._nonce += 1
            flags = b"\x01" if i < last else b"\x00"
            boxed = box(flags + body, prefix + short, key)
            out.append(frame(_MESSAGE + short + boxed, 0))
        return b"".join(out)

    def _on_frames(self, frames: list[bytes]) -> None:
        # Each MESSAGE comes as a frame of its own (libzmq sends them without the MORE flag:
        # the flag travels inside the box).
        if not self.ready:
            raise ZmtpError("CURVE: a message before the handshake ended")
        for body in frames:
            self._open_message(body)

    def _open_message(self, body: bytes) -> None:
        if len(body) < 33 or body[:8] != _MESSAGE:
            raise ZmtpError("CURVE: a frame that is not a MESSAGE command")
        short = body[8:16]
        self._peer_sent(short)
        try:
            plain = nacl.crypto_box_open_afternm(body[16:], self._decode_prefix + short, self._key)
        except CryptoError:
            raise ZmtpError("CURVE: a MESSAGE box that does not open") from None
        flags = plain[0]
        if flags & 0x02:
            return  # a command inside the box (libzmq's PING when heartbeats are on)
        self._partial.append(plain[1:])
        if not flags & _MORE:
            message, self._partial = self._partial, []
            self.on_message(message)

    def _on_command(self, body: bytes) -> None:
        name = command_name(body)
        if name == b"MESSAGE" and self.ready:
            self._open_message(body)  # a peer that flags MESSAGE frames as commands
            return
        if name == b"ERROR":
            reason = body[7 : 7 + body[6]] if len(body) > 6 else b""
            raise ZmtpError(f"CURVE: the peer refused us (ERROR {reason.decode(errors='replace')})")
        if self.ready:
            return
        self._handshake(name, body)

    def _handshake(self, name: bytes, body: bytes) -> None:
        raise NotImplementedError


class CurveClient(_Session):
    """The connecting side (a DEALER): our long-term keypair and the server's public key."""

    __slots__ = ("_cookie", "_public", "_secret", "_server", "_server_short", "_short_public",
                 "_short_secret", "_socket_type")  # fmt: skip

    def __init__(
        self,
        public: bytes,
        secret: bytes,
        server_public: bytes,
        *,
        write: Callable[[bytes], object],
        on_message: Callable[[list[bytes]], None],
        on_ready: Callable[[], None] = lambda: None,
        socket_type: bytes = b"DEALER",
    ) -> None:
        super().__init__(write, on_message, on_ready, _CLIENT_MESSAGE, _SERVER_MESSAGE)
        self._public, self._secret, self._server = public, secret, server_public
        self._short_public, self._short_secret = nacl.crypto_box_keypair()
        self._server_short = b""
        self._cookie = b""
        self._socket_type = socket_type

    def start(self) -> bytes:
        """Our greeting and HELLO (sent at once: the server reads them after its greeting)."""
        short = self._next_nonce()
        signature = nacl.crypto_box(bytes(64), _HELLO_NONCE + short, self._server,
                                    self._short_secret)  # fmt: skip
        hello = b"\x05HELLO" + b"\x01\x00" + bytes(72) + self._short_public + short + signature
        return greeting(b"CURVE", as_server=False) + frame(hello, _COMMAND)

    def _handshake(self, name: bytes, body: bytes) -> None:
        if name == b"WELCOME" and not self._cookie:
            if len(body) != 168:
                raise ZmtpError("CURVE: a malformed WELCOME")
            try:
                plain = nacl.crypto_box_open(
                    body[24:], b"WELCOME-" + body[8:24], self._server, self._short_secret
                )
            except CryptoError:
                raise ZmtpError(
                    "CURVE: WELCOME does not open (the server's key is not the one we know)"
                ) from None
            self._server_short, self._cookie = plain[:32], plain[32:128]
            self._key = nacl.crypto_box_beforenm(self._server_short, self._short_secret)
            self.write(frame(self._initiate(), _COMMAND))
        elif name == b"READY" and self._cookie:
            if len(body) < 30:
                raise ZmtpError("CURVE: a malformed READY")
            short = body[6:14]
            self._peer_sent(short)
            try:
                nacl.crypto_box_open_afternm(body[14:], _READY_NONCE + short, self._key)
            except CryptoError:
                raise ZmtpError("CURVE: READY does not open") from None
            self.ready = True
            self.on_ready()
        else:
            raise ZmtpError(f"CURVE: unexpected command {name!r} in the handshake")

    def _initiate(self) -> bytes:
        vouch_nonce = os.urandom(16)
        vouch = nacl.crypto_box(self._short_public + self._server, b"VOUCH---" + vouch_nonce,
                                self._server_short, self._secret)  # fmt: skip
        plain = self._public + vouch_nonce + vouch + _properties(self._socket_type)
        short = self._next_nonce()
        boxed = nacl.crypto_box(plain, _INITIATE_NONCE + short, self._server_short,
                                self._short_secret)  # fmt: skip
        return b"\x08INITIATE" + self._cookie + short + boxed


class CurveServer(_Session):
    """The listening side (the router's ROUTER): our long-term keypair and the client keys
    we admit. `client_key` is the admitted peer's long-term public key once ready."""

    __slots__ = ("_allowed", "_client_short", "_cookie_key", "_public", "_secret",
                 "_short_public", "_short_secret", "_socket_type", "client_key")  # fmt: skip

    def __init__(
        self,
        public: bytes,
        secret: bytes,
        allowed: frozenset[bytes],
        *,
        write: Callable[[bytes], object],
        on_message: Callable[[list[bytes]], None],
        on_ready: Callable[[], None] = lambda: None,
        socket_type: bytes = b"ROUTER",
    ) -> None:
        super().__init__(write, on_message, on_ready, _SERVER_MESSAGE, _CLIENT_MESSAGE)
        self._public, self._secret, self._allowed = public, secret, allowed
        self._short_public, self._short_secret = nacl.crypto_box_keypair()
        self._client_short = b""
        self._cookie_key = b""
        self._socket_type = socket_type
        self.client_key = b""

    def start(self) -> bytes:
        return greeting(b"CURVE", as_server=True)

    def _handshake(self, name: bytes, body: bytes) -> None:
        if name == b"HELLO" and not self._client_short:
            self._hello(body)
        elif name == b"INITIATE" and self._cookie_key:
            self._initiate(body)
        else:
            raise ZmtpError(f"CURVE: unexpected command {name!r} in the handshake")

    def _hello(self, body: bytes) -> None:
        if len(body) != 200 or body[6:8] != b"\x01\x00":
            raise ZmtpError("CURVE: a malformed HELLO")
        client_short, short = body[80:112], body[112:120]
        try:
            nacl.crypto_box_open(body[120:200], _HELLO_NONCE + short, client_short, self._secret)
        except CryptoError:
            raise ZmtpError(
                "CURVE: HELLO does not open (the client has another server key)"
            ) from None
        self._peer_sent(short)
        self._client_short = client_short
        self._cookie_key = os.urandom(32)
        cookie_nonce = os.urandom(16)
        cookie = cookie_nonce + nacl.crypto_secretbox(
            client_short + self._short_secret, b"COOKIE--" + cookie_nonce, self._cookie_key
        )
        welcome_nonce = os.urandom(16)
        boxed = nacl.crypto_box(self._short_public + cookie, b"WELCOME-" + welcome_nonce,
                                client_short, self._secret)  # fmt: skip
        self.write(frame(b"\x07WELCOME" + welcome_nonce + boxed, _COMMAND))

    def _initiate(self, body: bytes) -> None:
        if len(body) < 257:
            raise ZmtpError("CURVE: a malformed INITIATE")
        try:
            cookie = nacl.crypto_secretbox_open(
                body[25:105], b"COOKIE--" + body[9:25], self._cookie_key
            )
        except CryptoError:
            raise ZmtpError("CURVE: INITIATE carries a cookie we did not make") from None
        if cookie != self._client_short + self._short_secret:
            raise ZmtpError("CURVE: INITIATE carries another connection's cookie")
        short = body[105:113]
        self._peer_sent(short)
        try:
            plain = nacl.crypto_box_open(
                body[113:], _INITIATE_NONCE + short, self._client_short, self._short_secret
            )
        except CryptoError:
            raise ZmtpError("CURVE: INITIATE does not open") from None
        client_key = plain[:32]
        try:
            vouch = nacl.crypto_box_open(
                plain[48:128], b"VOUCH---" + plain[32:48], client_key, self._short_secret
            )
        except CryptoError:
            raise ZmtpError("CURVE: the client's vouch does not open") from None
        if vouch[:32] != self._client_short:
            raise ZmtpError("CURVE: the client's vouch is for another connection")
        self._key = nacl.crypto_box_beforenm(self._client_short, self._short_secret)
        if client_key not in self._allowed:
            # libzmq's ZAP answer for a key it does not know: 400.
            self.write(frame(b"\x05ERROR\x03400", _COMMAND))
            raise ZmtpError(f"CURVE: client key {z85.encode(client_key).decode()} is not allowed")
        self.client_key = client_key
        short = self._next_nonce()
        boxed = nacl.crypto_box_afternm(
            _properties(self._socket_type), _READY_NONCE + short, self._key
        )
        self.write(frame(b"\x05READY" + short + boxed, _COMMAND))
        self.ready = True
        self.on_ready()
