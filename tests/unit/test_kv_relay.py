"""The engine agent's KV-event relay (engine_launch/kv_relay.py) into the router's relay
socket (router/kv_subscriber.py), over real ZeroMQ with CURVE: vLLM's frames in order, a gap
replayed through the agent, the first message's replay, malformed frames counted and
dropped, and nothing from a peer without the engine key."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.curve import generate_keys, make_client, start_authenticator
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.engine_launch.engine import (
    KV_DIR_PREFIX,
    EngineOptions,
    EngineRunner,
    sweep_kv_dirs,
)
from hpcserve.engine_launch.kv_relay import KvEventRelay
from hpcserve.engine_launch.vllm_args import kv_events_endpoints, vllm_argv, vllm_env
from hpcserve.router.kv_subscriber import KvEventSubscriber
from hpcserve.router.prefix_index import PrefixIndex
from tests.ports import free_port

BS = 4
TOKENS = list(range(40))
HASHES = prompt_block_hashes(TOKENS, BS)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Setup:
    pub: kw.KVEventPublisher  # vLLM's publisher, as vLLM binds it: ipc in a 0700 directory
    relay: KvEventRelay
    sub: KvEventSubscriber
    clock: Clock
    keys: Path
    ctx: zmq.Context


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    keys = generate_keys(tmp_path / "curve")
    ctx = zmq.Context()  # its own: the ZAP handler's inproc address is per context
    auth = start_authenticator(ctx, keys)
    private = tmp_path / "kv"
    private.mkdir(mode=0o700)
    events, replay = f"ipc://{private}/events", f"ipc://{private}/replay"
    pub = kw.KVEventPublisher(events, replay_endpoint=replay, topic="r1", context=ctx)
    clock = Clock()
    sub = KvEventSubscriber(
        PrefixIndex(), clock=clock, silence_s=5.0, replay_timeout_s=2.0, context=ctx
    )
    bound = sub.bind_relay("tcp://127.0.0.1:*", str(keys))
    sub.watch("r1", "", "", "r1", relayed=True)
    relay = KvEventRelay(events, replay, "r1", curve_dir=str(keys), poll_ms=10, context=ctx)
    relay.start()
    relay.connect_router(bound.replace("0.0.0.0", "127.0.0.1"))
    try:
        yield Setup(pub, relay, sub, clock, keys, ctx)
    finally:
        relay.stop()
        sub.close()
        pub.close()
        auth.stop()
        ctx.term()


def pump(s: Setup, until, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s.pub.service_replay()  # vLLM's publisher thread answers replay requests
        assert s.sub.relay is not None
        s.sub.relay.poll(10)
        s.sub.drain_relay()
        s.sub.tick()
        if until():
            return
    raise AssertionError("condition not reached")


def block(i: int, parent: bool = True) -> kw.BlockStored:
    return kw.BlockStored([i], i - 1 if parent and i else None, TOKENS[i * BS : (i + 1) * BS], BS)


def depth(sub: KvEventSubscriber) -> int:
    return sub.index.match(HASHES).get("r1", 0)


def connect(s: Setup) -> None:
    """PUB drops until the relay's subscription lands: publish block 0 until it arrives."""
    deadline = time.monotonic() + 20
    stream = s.sub._streams[b"r1"]
    while (depth(s.sub) == 0 or stream.replaying) and time.monotonic() < deadline:
        s.pub.publish([block(0)])
        pump(s, lambda: True, 0.05)
    assert depth(s.sub) == 1


def test_relayed_events_fill_the_index_in_order(setup: Setup) -> None:
    connect(setup)
    setup.pub.publish([block(1), block(2)])
    setup.pub.publish([block(3)])
    pump(setup, lambda: depth(setup.sub) == 4)
    setup.pub.publish([kw.BlockRemoved([3])])
    pump(setup, lambda: depth(setup.sub) == 3)
    assert setup.relay.counts.forwarded >= 4
    assert setup.sub.metrics.bad._value.get() == 0


def test_the_first_message_is_replayed_from_zero_through_the_agent(setup: Setup) -> None:
    # Published before the router heard of the stream: the first relayed message (seq 2)
    # makes the router ask the agent for a replay from 0, which vLLM's buffer holds.
    setup.pub.publish([block(0)])
    setup.pub.publish([block(1)])
    connect_deadline = time.monotonic() + 20
    while depth(setup.sub) < 3 and time.monotonic() < connect_deadline:
        setup.pub.publish([block(2)])
        pump(setup, lambda: True, 0.05)
    assert depth(setup.sub) == 3
    assert setup.relay.counts.replays >= 1


def test_a_gap_is_filled_by_a_replay_through_the_agent(setup: Setup) -> None:
    connect(setup)
    relay_sock = setup.sub.relay
    assert relay_sock is not None
    # Two batches lost between the agent and the router: taken off the socket, never handled.
    setup.pub.publish([block(1)])
    setup.pub.publish([block(2)])
    for _ in range(2):
        assert relay_sock.poll(60_000), "a relayed batch never arrived"
        relay_sock.recv_multipart()
    replays = setup.relay.counts.replays
    deadline = time.monotonic() + 20
    while depth(setup.sub) < 4 and time.monotonic() < deadline:
        setup.pub.publish([block(3)])  # blocks 3 again and again: idempotent
        pump(setup, lambda: True, 0.05)
    assert depth(setup.sub) == 4
    assert setup.sub.metrics.gaps._value.get() >= 1
    assert setup.relay.counts.replays > replays
    assert setup.relay.counts.replay_frames >= 3  # blocks 1 and 2, and the end marker


def test_a_replay_the_agent_never_answers_clears_the_replica(setup: Setup) -> None:
    connect(setup)
    setup.relay.stop()  # the agent is gone: the gap's replay goes unanswered
    stream = setup.sub._streams[b"r1"]
    assert setup.sub._ask_replay(stream, 5)
    setup.clock.now += 10
    setup.sub.tick()
    assert depth(setup.sub) == 0
    assert not stream.replaying


def agent_dealer(s: Setup, routing_id: bytes) -> zmq.Socket:
    """A DEALER holding the engine key, as an agent connects."""
    sock = s.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    make_client(sock, s.keys)
    assert s.sub.relay is not None
    sock.connect(s.sub.relay_endpoint.replace("0.0.0.0", "127.0.0.1"))
    return sock


def test_malformed_and_foreign_relayed_frames_are_counted_and_dropped(setup: Setup) -> None:
    connect(setup)
    rogue = agent_dealer(setup, b"r2")
    try:
        stream = setup.sub._streams[b"r1"]
        seq = stream.next_seq
        assert seq is not None
        bad = setup.sub.metrics.bad._value.get()
        payload = kw.encode_batch(kw.KVEventBatch(0.0, [block(1)], 0))
        # Another replica's topic from this connection: refused (an agent speaks for its own).
        rogue.send_multipart([b"r1", kw.encode_seq(seq), payload])
        # A sequence frame of the wrong size; a message of four frames; an undecodable payload.
        rogue.send_multipart([b"r1", b"\x00\x01", payload])
        rogue.send_multipart([b"r1", kw.encode_seq(seq), payload, b"extra"])
        rogue.send(b"")  # an empty frame alone: neither a live message nor a replay answer
        pump(setup, lambda: setup.sub.metrics.bad._value.get() >= bad + 4)
        assert depth(setup.sub) == 1  # block 1 of the rogue messages was never applied
        # The real agent's stream goes on unharmed.
        setup.pub.publish([block(1)])
        pump(setup, lambda: depth(setup.sub) == 2)
        # A malformed replay request to the agent is dropped there, not passed to vLLM.
        assert setup.sub.relay is not None
        setup.sub.relay.send_multipart([b"r1", b"not a replay request"])
        deadline = time.monotonic() + 20
        while setup.relay.counts.bad_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert setup.relay.counts.bad_requests == 1
    finally:
        rogue.close(0)


def test_a_peer_without_the_engine_key_never_reaches_the_relay_socket(
    setup: Setup, tmp_path: Path
) -> None:
    connect(setup)
    assert setup.sub.relay is not None
    endpoint = setup.sub.relay_endpoint.replace("0.0.0.0", "127.0.0.1")
    ctx = setup.ctx
    plain = ctx.socket(zmq.DEALER)
    stranger = ctx.socket(zmq.DEALER)
    other = generate_keys(tmp_path / "other")
    (other / "router.key").write_bytes((setup.keys / "router.key").read_bytes())
    make_client(stranger, other)  # a key pair the router was never given
    try:
        for sock in (plain, stranger):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, b"r1")
        plain_monitor = _start(plain, endpoint)
        stranger_monitor = _start(stranger, endpoint)
        assert plain_monitor() == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        assert stranger_monitor() == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        # And the trusted agent's stream was never displaced.
        setup.pub.publish([block(1)])
        pump(setup, lambda: depth(setup.sub) == 2)
    finally:
        plain.close(0)
        stranger.close(0)


def _start(sock: zmq.Socket, endpoint: str):  # type: ignore[no-untyped-def]
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)

    def outcome() -> int:
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

    return outcome


def test_the_engine_publishes_in_a_directory_only_its_account_may_enter(tmp_path: Path) -> None:
    options = EngineOptions(
        str(tmp_path), "m", f"tcp://127.0.0.1:{free_port()}", engine="sim",
        bind_host="127.0.0.1",
    )  # fmt: skip
    runner = EngineRunner(options)
    agent = RegistryAgent(options.router, runner.registration())
    try:
        runner.open_kv_events(agent)
        directory = Path(runner.spec.kv_events_dir)
        st = directory.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        events, replay = kv_events_endpoints(runner.spec)
        argv = " ".join(vllm_argv(runner.spec))
        assert events in argv and replay in argv and "tcp://" not in argv.split("--kv")[1]
        registration = runner.registration()
        assert registration.kv_events_relayed and not registration.kv_events_endpoint
        assert agent.on_kv_relay is not None  # the relay connects once the router answers
    finally:
        runner.close_kv_events()
        agent.close()
        runner.release_ports()
    assert not directory.exists()


def test_the_private_directory_holds_vllms_own_sockets_and_fits_their_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long TMPDIR: vLLM's ipc paths (<directory>/<uuid4>) would not fit a sockaddr_un.
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    options = EngineOptions(
        str(tmp_path), "m", f"tcp://127.0.0.1:{free_port()}", engine="vllm-cpu",
        bind_host="127.0.0.1",
    )  # fmt: skip
    runner = EngineRunner(options)
    try:
        directory = Path(runner.open_private_dir())
        assert runner.open_private_dir() == str(directory)  # once per engine
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert len(f"{directory}/{'0' * 36}") < 108 and directory.parent == Path("/tmp")
        env = vllm_env(runner.spec, {})
        assert env["VLLM_RPC_BASE_PATH"] == env["TMPDIR"] == str(directory)
    finally:
        runner.close_private_dir()
        runner.release_ports()
    assert not directory.exists()


def test_the_router_tells_engines_where_to_relay(tmp_path: Path) -> None:
    from hpcserve.config import RouterConfig

    config = RouterConfig(registry_bind="tcp://*:5560", registry_endpoint="tcp://head:5560")
    assert config.kv_relay_binds() == "tcp://*:*"
    assert config.kv_relay_dial("tcp://0.0.0.0:41234") == "tcp://head:41234"
    ipc = RouterConfig(registry_bind=f"ipc://{tmp_path}/registry")
    assert ipc.kv_relay_binds() == f"ipc://{tmp_path}/registry.kv"
    fixed = RouterConfig(kv_relay_bind="tcp://*:5562", kv_relay_endpoint="tcp://h:5562")
    assert (fixed.kv_relay_binds(), fixed.kv_relay_dial("tcp://0.0.0.0:5562")) == (
        "tcp://*:5562",
        "tcp://h:5562",
    )


def test_a_killed_engines_kv_directory_is_swept_by_the_next_engine(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"{KV_DIR_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{KV_DIR_PREFIX}{os.getpid()}-def"
    for path in (stale, live):
        path.mkdir(mode=0o700)
        (path / "events").touch()
    sweep_kv_dirs(tmp_path)
    assert not stale.exists() and live.exists()


def test_the_relay_follows_a_router_that_moved(setup: Setup) -> None:
    connect(setup)
    setup.pub.publish([block(1)])
    pump(setup, lambda: depth(setup.sub) == 2)
    # A new router (a restart on another port): its ack names the new relay address.
    moved = KvEventSubscriber(PrefixIndex(), clock=setup.clock, context=setup.ctx)
    try:
        bound = moved.bind_relay("tcp://127.0.0.1:*", str(setup.keys))
        moved.watch("r1", "", "", "r1", relayed=True)
        setup.relay.connect_router(bound)
        deadline = time.monotonic() + 20
        # Its first message asks for a replay from 0: blocks 0 and 1 come back from vLLM's
        # buffer through the agent, block 2 live.
        while depth(moved) < 3 and time.monotonic() < deadline:
            setup.pub.publish([block(2)])
            for _ in range(5):
                setup.pub.service_replay()
                assert moved.relay is not None
                moved.relay.poll(10)
                moved.drain_relay()
                moved.tick()
        assert depth(moved) == 3
        assert setup.relay.connected_to == bound
    finally:
        moved.close()
