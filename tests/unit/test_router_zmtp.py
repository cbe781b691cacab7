"""contracts/zmtp.py: the router's ZMTP ROUTER against real libzmq DEALERs (tcp and ipc),
multipart messages and long frames both ways, a reply bigger than the socket buffer, a peer
that does not speak ZMTP, an oversized frame, and bad bind endpoints named by their key."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq

from hpcserve.config import RouterConfig
from hpcserve.contracts.zmtp import (
    GREETING,
    MAX_FRAME,
    ZmtpError,
    ZmtpParser,
    ZmtpRouter,
    parse_endpoint,
    ready,
)
from hpcserve.router.server import RouterServer
from tests.ports import free_port


def serve_until(router: ZmtpRouter, poller: zmq.Poller, done, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    """Poll and collect (peer, frames) until `done(received)`."""
    received: list[tuple[bytes, list[bytes]]] = []
    for _ in range(int(timeout_s * 100)):
        received += router.receive(dict(poller.poll(10)))
        if done(received):
            return received
    raise AssertionError(f"timed out; received {received!r}")


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_a_libzmq_dealer_talks_multipart_with_long_frames_both_ways(
    kind: str, tmp_path: Path
) -> None:
    endpoint = (
        f"tcp://127.0.0.1:{free_port()}" if kind == "tcp" else f"ipc://{tmp_path / 'routing'}"
    )
    poller = zmq.Poller()
    router = ZmtpRouter(endpoint, poller)
    router.bind()
    client = dealer(endpoint)
    try:
        long = b"y" * 300
        client.send_multipart([b"a", long])
        [(peer, frames)] = serve_until(router, poller, lambda got: got)
        assert frames == [b"a", long]
        assert router.send(peer, [long, b"b"])
        assert client.poll(2000) and client.recv_multipart() == [long, b"b"]
        # More than the kernel takes at once: the rest leaves as the peer reads (POLLOUT).
        big = b"z" * (8 << 20)
        assert router.send(peer, [big])
        got: list[bytes] = []

        def received(_: object) -> bool:
            if client.poll(0):
                got.extend(client.recv_multipart())
            return bool(got)

        serve_until(router, poller, received)
        assert got == [big]
    finally:
        client.close(0)
        router.close()
    if kind == "ipc":
        assert not (tmp_path / "routing").exists()


def test_a_peer_that_does_not_speak_zmtp_is_dropped_and_others_are_served() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    poller = zmq.Poller()
    router = ZmtpRouter(endpoint, poller)
    router.bind()
    rogue = socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
    client = dealer(endpoint)
    try:
        rogue.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64)
        client.send(b"hello")
        [(peer, frames)] = serve_until(router, poller, lambda got: got)
        assert frames == [b"hello"]
        rogue.settimeout(5)
        assert rogue.recv(4096)[:1] == b"\xff"  # our greeting, then the connection closes
        assert rogue.recv(4096) == b""
        assert router.send(peer, [b"still here"])
        assert client.poll(2000) and client.recv() == b"still here"
        assert not router.send(b"\x00\x00\x00\x99", [b"x"]), "an unknown peer: dropped"
    finally:
        rogue.close()
        client.close(0)
        router.close()


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RuntimeError, match=f"router cannot bind {endpoint}"):
            ZmtpRouter(endpoint, zmq.Poller()).bind()


@pytest.mark.parametrize(
    ("endpoint", "parsed"),
    [
        ("tcp://*:5561", ("tcp", "0.0.0.0", 5561)),
        ("tcp://10.0.0.5:5561", ("tcp", "10.0.0.5", 5561)),
        ("ipc:///run/hpcserve/routing", ("ipc", "/run/hpcserve/routing", 0)),
    ],
)
def test_bind_endpoints_parse(endpoint: str, parsed: tuple[str, str, int]) -> None:
    assert parse_endpoint(endpoint, "router.routing_bind", bind=True) == parsed


@pytest.mark.parametrize("endpoint", ["tcp://*", "inproc://x", "ipc://", "tcp://:5"])
def test_bad_bind_endpoints_name_the_setting(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"router\.routing_bind"):
        ZmtpRouter(endpoint, zmq.Poller())


def test_a_router_with_a_bad_routing_bind_fails_to_start_naming_the_key() -> None:
    config = RouterConfig(
        registry_bind=f"tcp://127.0.0.1:{free_port()}",
        routing_bind="tcp://*",
        metrics_port=0,
        allow_plain_loopback=True,
    )
    with pytest.raises(RuntimeError, match=r"router\.routing_bind"):
        RouterServer(config).bind()


def test_a_frame_larger_than_the_limit_closes_the_connection() -> None:
    got: list[list[bytes]] = []
    parser = ZmtpParser(lambda body: None, got.append)
    parser.feed(GREETING + ready(b"DEALER") + b"\x00\x02ok")
    assert got == [[b"ok"]]
    with pytest.raises(ZmtpError, match="bytes"):
        parser.feed(b"\x02" + (MAX_FRAME + 1).to_bytes(8, "big"))
