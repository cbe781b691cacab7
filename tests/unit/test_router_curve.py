"""CURVE on the registry socket: keys from the CLI, engines with the key register, others
cannot; plain mode is refused on a non-loopback bind unless allowed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from hpcserve.cli import main
from hpcserve.config import RouterConfig
from hpcserve.contracts import protocol as p
from hpcserve.contracts.curve import (
    CurveError,
    check_plain_bind,
    generate_keys,
    is_loopback_endpoint,
    make_client,
)
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.router.server import RouterServer
from tests.ports import free_port
from tests.routers import loopback_router_config, running_router


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5560", True),
        ("tcp://[::1]:5560", True),
        ("tcp://localhost:5560", True),
        ("ipc:///tmp/x", True),
        ("tcp://0.0.0.0:5560", False),
        ("tcp://*:5560", False),
        ("tcp://10.1.2.3:5560", False),
        ("tcp://ctl-node:5560", False),
    ],
)
def test_loopback_endpoints(endpoint, local):
    assert is_loopback_endpoint(endpoint) is local


def test_plain_mode_is_refused_on_a_public_bind_unless_allowed():
    with pytest.raises(CurveError, match=r"router.registry_bind tcp://0.0.0.0:1 .*curve_dir"):
        check_plain_bind("tcp://0.0.0.0:1", "", False)
    check_plain_bind("tcp://0.0.0.0:1", "", True)
    check_plain_bind("tcp://0.0.0.0:1", "/keys", False)
    check_plain_bind("tcp://127.0.0.1:1", "", False)


def test_keys_cli_writes_keys_once(tmp_path, capsys):
    assert main(["keys", "--dir", str(tmp_path / "k")]) == 0
    assert "curve_dir" in capsys.readouterr().out
    assert (tmp_path / "k" / "clients" / "engine.key").exists()
    assert (tmp_path / "k" / "router.key_secret").stat().st_mode & 0o077 == 0
    assert main(["keys", "--dir", str(tmp_path / "k")]) == 1
    assert "already holds keys" in capsys.readouterr().err
    assert main(["keys", "--dir", str(tmp_path / "k"), "--force"]) == 0


@pytest.fixture
def curve_router(tmp_path) -> Iterator[tuple[RouterServer, Path]]:
    """A running router whose registry socket takes only engines with the keys in the dir."""
    keys = generate_keys(tmp_path / "curve")
    config = loopback_router_config(curve_dir=str(keys), lease_s=6.0, heartbeat_s=2.0)
    with running_router(config) as server:
        yield server, keys


def test_only_engines_with_the_cluster_key_can_register(curve_router, tmp_path):
    server, keys = curve_router
    config = server.config
    trusted = RegistryAgent(
        config.registry_bind, p.Register("good", "m", "http://good"), curve_dir=str(keys)
    )
    ctx = zmq.Context.instance()
    plain = ctx.socket(zmq.DEALER)
    stranger = ctx.socket(zmq.DEALER)
    other = generate_keys(tmp_path / "other")
    (other / "router.key").write_bytes((keys / "router.key").read_bytes())
    make_client(stranger, other)  # a key pair the router was never given
    try:
        for sock in (plain, stranger):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 200)
            sock.connect(config.registry_bind)
        trusted.register()
        deadline = time.monotonic() + 10
        while not trusted.registered and time.monotonic() < deadline:
            trusted.process_replies(0.2)
        assert trusted.registered
        for sock, rid in ((plain, "bad"), (stranger, "stranger")):
            # Without the cluster's key the handshake fails: nothing is delivered.
            with contextlib.suppress(zmq.Again):
                sock.send(p.encode(p.Register(rid, "m", "http://x")))
            assert not sock.poll(1000)
        assert [r.replica_id for r in server.registry] == ["good"]
    finally:
        trusted.close()
        plain.close(0)
        stranger.close(0)


def test_router_refuses_a_plain_public_registry():
    config = RouterConfig(
        registry_bind=f"tcp://0.0.0.0:{free_port()}",
        routing_bind=f"tcp://127.0.0.1:{free_port()}",
        metrics_port=0,
        allow_plain_loopback=True,  # loopback only: not a public bind
    )
    server = RouterServer(config, context=zmq.Context.instance())
    with pytest.raises(CurveError, match="allow_plain_remote"):
        server.bind()
    server.kv_events.close()


def test_an_engine_with_a_wrong_key_never_blocks_and_says_why(curve_router, tmp_path, caplog):
    server, keys = curve_router
    config = server.config
    other = generate_keys(tmp_path / "other")
    (other / "router.key").write_bytes((keys / "router.key").read_bytes())
    agent = RegistryAgent(
        config.registry_bind, p.Register("x", "m", "http://x"), curve_dir=str(other)
    )
    try:
        agent.register()
        # Far beyond the send queue: a blocking send would hang here (pytest-timeout).
        for _ in range(100):
            agent.heartbeat(p.ReplicaLoad())
        assert not agent.deregister("test", timeout_s=0.2)
        assert not agent.registered
        assert "CURVE key" in caplog.text
        assert list(server.registry) == []
    finally:
        agent.close()
