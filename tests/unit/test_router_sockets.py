"""The router over real ZeroMQ sockets: registry leases, re-registration, routing."""

import time

import pytest
import zmq

from hpcserve.contracts import protocol as p
from hpcserve.contracts.router_client import list_models, list_replicas
from hpcserve.engine_launch.agent import RegistryAgent
from tests.routers import loopback_router_config, running_router

# Replies come from the router's thread in this process: waits that end at the reply, with
# deadlines a process descheduled for seconds does not reach.
REPLY_S = 30.0


@pytest.fixture
def router():
    """No lease lapses here unless a test waits for one: a registered replica is not dropped
    because this process (router and agent alike) was descheduled past a short lease."""
    with running_router(loopback_router_config(lease_s=600.0)) as server:
        yield server


@pytest.fixture
def short_lease_router():
    with running_router(loopback_router_config(lease_s=1.0)) as server:
        yield server


def wait_for(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_agent_registers_heartbeats_and_deregisters(router):
    endpoint = router.config.registry_bind
    routing = router.config.routing_bind
    agent = RegistryAgent(endpoint, p.Register("r1", "tiny", "http://127.0.0.1:9", node="n1"))
    try:
        agent.register()
        agent.process_replies(REPLY_S)
        assert agent.registered
        assert [m.id for m in list_models(routing, REPLY_S)] == ["tiny"]
        agent.heartbeat(p.ReplicaLoad(running=2, waiting=1))
        agent.process_replies(REPLY_S)  # the ack: the load is recorded
        (info,) = list_replicas(routing, REPLY_S)
        assert (info.replica_id, info.node, info.load.running) == ("r1", "n1", 2)
        assert agent.deregister("test over", timeout_s=REPLY_S)
        assert list_models(routing, REPLY_S) == []
    finally:
        agent.close()


def test_silent_replica_leaves_routing_when_its_lease_lapses(short_lease_router):
    router = short_lease_router
    agent = RegistryAgent(router.config.registry_bind, p.Register("r2", "tiny", "http://x"))
    try:
        agent.register()
        agent.process_replies(REPLY_S)
        assert agent.registered
        # No heartbeats: lease is 1 s in the fixture.
        assert wait_for(lambda: not list_models(router.config.routing_bind, REPLY_S))
        assert router.metrics.lease_expiries._value.get() == 1
        # The next heartbeat is answered with ReRegister and the agent registers again.
        agent.heartbeat(p.ReplicaLoad())
        # ReRegister -> the agent sends its registration; then the router's ack
        assert wait_for(lambda: agent.process_replies(0.05) or agent.registered)
        assert router.metrics.registry_messages.labels("register")._value.get() == 2

        def routed_while_heartbeating() -> bool:  # as a live engine keeps its 1 s lease
            agent.heartbeat(p.ReplicaLoad())
            agent.process_replies(0.05)
            return [m.id for m in list_models(router.config.routing_bind, REPLY_S)] == ["tiny"]

        assert wait_for(routed_while_heartbeating)
    finally:
        agent.close()


def test_route_counts_in_flight_and_release_frees_it(router):
    ctx = zmq.Context.instance()
    agent = RegistryAgent(router.config.registry_bind, p.Register("r3", "tiny", "http://x"))
    gateway = ctx.socket(zmq.DEALER)
    gateway.connect(router.config.routing_bind)
    try:
        agent.register()
        agent.process_replies(REPLY_S)

        def ask(msg):
            gateway.send(p.encode(msg))
            assert gateway.poll(int(REPLY_S * 1000))
            return p.routing_reply_decoder.decode(gateway.recv())

        epoch = router.epoch  # new at each router start (in-flight re-declaration)
        assert ask(p.Route(1, "tiny")) == p.RouteReply(1, "r3", "http://x", epoch=epoch)
        assert ask(p.Route(2, "nope")) == p.RouteReply(2, error="no_replica")
        assert list_replicas(router.config.routing_bind, REPLY_S)[0].in_flight == 1
        gateway.send(p.encode(p.Release("r3")))
        assert wait_for(
            lambda: list_replicas(router.config.routing_bind, REPLY_S)[0].in_flight == 0
        )
    finally:
        gateway.close(0)
        agent.close()


def test_garbage_is_counted_and_does_not_stop_the_router(router):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(router.config.registry_bind)
    try:
        sock.send(b"\xc1not msgpack")
        sock.send_multipart([b"two", b"frames"])
        assert wait_for(lambda: router.metrics.bad_messages.labels("registry")._value.get() == 2)
        assert list_models(router.config.routing_bind, REPLY_S) == []
    finally:
        sock.close(0)
