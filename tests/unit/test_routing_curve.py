"""CURVE on the routing socket (contracts/zmtp_curve.py): our ZMTP ends against each other
and against libzmq, a peer without the gateway key refused (plain, a stranger's key, an
engine's key), plain refused on a non-loopback bind unless allowed, and the box's own
checks (a replayed nonce, a tampered box)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hpcserve.config import RouterConfig
from hpcserve.contracts import protocol as p
from hpcserve.contracts.curve import CurveError, generate_keys
from hpcserve.contracts.router_client import RouterQueryError, list_models, list_replicas
from hpcserve.contracts.zmtp import ZmtpError
from hpcserve.contracts.zmtp_curve import (
    ClientKeys,
    CurveClient,
    CurveServer,
    load_keypair,
    load_public_key,
    routing_client_keys,
    routing_server_keys,
)
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.routing_client import RouterUnavailable, RoutingClient
from hpcserve.router.server import RouterServer
from tests.ports import free_port
from tests.routers import loopback_router_config, running_router


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return generate_keys(tmp_path / "curve")


@pytest.fixture
def curve_router(keys: Path) -> Iterator[RouterServer]:
    config = loopback_router_config(curve_dir=str(keys))
    with running_router(config) as server:
        agent = RegistryAgent(
            config.registry_bind, p.Register("a", "docs", "http://127.0.0.1:9"), curve_dir=str(keys)
        )
        try:
            agent.register()
            agent.process_replies(30.0)
            assert agent.registered
            yield server
        finally:
            agent.close()


async def _models(endpoint: str, curve: ClientKeys | None, timeout_s: float) -> p.ModelList:
    client = RoutingClient(endpoint, timeout_s=timeout_s, curve=curve)
    await client.start()
    try:
        return await client.models()
    finally:
        await client.close()


def test_the_gateway_key_routes_over_curve(curve_router: RouterServer, keys: Path) -> None:
    endpoint = curve_router.config.routing_bind
    listed = asyncio.run(_models(endpoint, routing_client_keys(str(keys)), 30.0))
    assert [(m.id, m.replicas) for m in listed.models] == [("docs", 1)]
    # The CLI's libzmq DEALER with the same key, as `hpcserve status` asks.
    assert [r.replica_id for r in list_replicas(endpoint, 30.0, curve_dir=str(keys))] == ["a"]
    assert curve_router._routing is not None and curve_router._routing.refused == 0


def test_a_gateway_without_the_key_is_refused(
    curve_router: RouterServer, keys: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = curve_router.config.routing_bind
    routing = curve_router._routing
    assert routing is not None
    # Plain: the router drops it at the greeting; the request waits out its deadline.
    with pytest.raises(RouterUnavailable):
        asyncio.run(_models(endpoint, None, 1.0))
    # A key pair the router was never given (it knows the router's public key).
    other = generate_keys(tmp_path / "other")
    (other / "router.key").write_bytes((keys / "router.key").read_bytes())
    with caplog.at_level(logging.WARNING), pytest.raises(RouterUnavailable):
        asyncio.run(_models(endpoint, routing_client_keys(str(other)), 1.0))
    assert "refused us (ERROR 400)" in caplog.text
    assert "is not allowed" in caplog.text  # the router's side
    # The engines' key registers replicas; it does not route.
    public, secret = load_keypair(keys / "engine.key_secret")
    engine = ClientKeys(public, secret, load_public_key(keys / "router.key"))
    with pytest.raises(RouterUnavailable):
        asyncio.run(_models(endpoint, engine, 1.0))
    assert routing.refused >= 3
    with pytest.raises(RouterQueryError):
        list_models(endpoint, 0.5)  # the CLI without keys


def _handshake_outcome(sock: zmq.Socket, endpoint: str) -> int:
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    try:
        while True:
            assert monitor.poll(30_000), "no handshake event"
            event = int(recv_monitor_message(monitor)["event"])
            if event & (
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            ):
                return event
    finally:
        sock.disable_monitor()
        monitor.close(0)


def test_libzmq_sees_our_router_refuse_a_stranger_and_admit_the_gateway(
    curve_router: RouterServer, keys: Path, tmp_path: Path
) -> None:
    endpoint = curve_router.config.routing_bind
    ctx = zmq.Context.instance()
    other = generate_keys(tmp_path / "other")
    socks = []
    try:
        for secret in (other / "gateway.key_secret", keys / "gateway.key_secret"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            public, private = zmq.auth.load_certificate(str(secret))
            sock.curve_publickey, sock.curve_secretkey = public, private
            sock.curve_serverkey = zmq.auth.load_certificate(str(keys / "router.key"))[0]
            socks.append(sock)
        stranger, gateway = socks
        assert _handshake_outcome(stranger, endpoint) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert _handshake_outcome(gateway, endpoint) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        gateway.send(p.encode(p.ListModels(7)))
        assert gateway.poll(30_000)
        reply = p.routing_reply_decoder.decode(gateway.recv())
        assert isinstance(reply, p.ModelList) and reply.request_id == 7
    finally:
        for sock in socks:
            sock.close(0)


def test_plain_routing_is_refused_on_a_non_loopback_bind_unless_allowed() -> None:
    config = RouterConfig(
        registry_bind=f"tcp://127.0.0.1:{free_port()}",
        routing_bind=f"tcp://0.0.0.0:{free_port()}",
        metrics_port=0,
        allow_plain_loopback=True,  # loopback only: not a public bind
    )
    with pytest.raises(CurveError, match=r"router\.routing_bind .* the routing socket"):
        RouterServer(config, context=zmq.Context.instance()).bind()
    allowed = RouterConfig(
        registry_bind=config.registry_bind,
        routing_bind=config.routing_bind,
        allow_plain_remote=True,
        metrics_port=0,
    )
    with running_router(allowed) as server:
        assert server._routing is not None and server._routing.curve is None


def test_a_kv_relay_bound_on_every_interface_needs_keys_too() -> None:
    config = loopback_router_config(kv_relay_bind=f"tcp://*:{free_port()}")
    with pytest.raises(CurveError, match=r"router\.kv_relay_bind"):
        RouterServer(config, context=zmq.Context.instance()).bind()


def test_a_key_directory_without_the_gateway_key_says_how_to_add_it(keys: Path) -> None:
    (keys / "gateways" / "gateway.key").unlink()
    with pytest.raises(RuntimeError, match="no gateway public keys"):
        routing_server_keys(str(keys))
    (keys / "gateway.key_secret").unlink()
    generate_keys(keys)  # `hpcserve keys` on a directory from before: adds the gateway key
    assert routing_server_keys(str(keys)) is not None
    assert routing_client_keys(str(keys)) is not None


def _pair(keys: Path) -> tuple[CurveClient, CurveServer, list[list[bytes]], list[list[bytes]]]:
    """A client and a server session talking through in-memory pipes."""
    server_keys = routing_server_keys(str(keys))
    client_keys = routing_client_keys(str(keys))
    assert server_keys is not None and client_keys is not None
    to_server: list[list[bytes]] = []
    to_client: list[list[bytes]] = []
    server_pipe: list[bytes] = []  # bytes on their way to the server
    client_pipe: list[bytes] = []
    server = server_keys.server(client_pipe.append, to_server.append, lambda: None)
    client = client_keys.client(server_pipe.append, to_client.append, lambda: None)
    client_pipe.append(server.start())
    server_pipe.append(client.start())
    while server_pipe or client_pipe:
        if server_pipe:
            server.feed(server_pipe.pop(0))
        if client_pipe:
            client.feed(client_pipe.pop(0))
    assert client.ready and server.ready
    return client, server, to_server, to_client


def test_messages_are_boxed_and_a_replayed_or_tampered_box_is_refused(keys: Path) -> None:
    client, server, to_server, to_client = _pair(keys)
    wire = client.encode([b"route", b"me"])
    assert b"route" not in wire  # encrypted on the wire
    server.feed(wire)
    assert to_server == [[b"route", b"me"]]
    client.feed(server.encode([b"ok"]))
    assert to_client == [[b"ok"]]
    with pytest.raises(ZmtpError, match="nonce"):
        server.feed(wire)  # the same boxes again
    client2, server2, _, _ = _pair(keys)
    tampered = bytearray(client2.encode([b"x" * 40]))
    tampered[-1] ^= 1
    with pytest.raises(ZmtpError, match="does not open"):
        server2.feed(bytes(tampered))
