"""The router over real ZeroMQ sockets: registry leases, re-registration, routing."""

import time

import zmq

from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.router import protocol as p
from hpcserve.router.client import list_models, list_replicas


def wait_for(predicate, timeout_s=5.0):
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
        agent.process_replies(2.0)
        assert agent.registered
        assert [m.id for m in list_models(routing)] == ["tiny"]
        agent.heartbeat(p.ReplicaLoad(running=2, waiting=1))
        agent.process_replies(0.5)
        (info,) = list_replicas(routing)
        assert (info.replica_id, info.node, info.load.running) == ("r1", "n1", 2)
        assert agent.deregister("test over")
        assert list_models(routing) == []
    finally:
        agent.close()


def test_silent_replica_leaves_routing_when_its_lease_lapses(router):
    agent = RegistryAgent(router.config.registry_bind, p.Register("r2", "tiny", "http://x"))
    try:
        agent.register()
        agent.process_replies(2.0)
        assert list_models(router.config.routing_bind)
        # No heartbeats: lease is 1 s in the fixture.
        assert wait_for(lambda: not list_models(router.config.routing_bind), timeout_s=3)
        assert router.metrics.lease_expiries._value.get() == 1
        # The next heartbeat is answered with ReRegister and the agent registers again.
        agent.heartbeat(p.ReplicaLoad())
        agent.process_replies(0.5)  # ReRegister -> the agent sends its registration
        agent.process_replies(0.5)  # the router's ack
        assert agent.registered
        assert [m.id for m in list_models(router.config.routing_bind)] == ["tiny"]
    finally:
        agent.close()


def test_route_counts_in_flight_and_release_frees_it(router):
    ctx = zmq.Context.instance()
    agent = RegistryAgent(router.config.registry_bind, p.Register("r3", "tiny", "http://x"))
    gateway = ctx.socket(zmq.DEALER)
    gateway.connect(router.config.routing_bind)
    try:
        agent.register()
        agent.process_replies(2.0)

        def ask(msg):
            gateway.send(p.encode(msg))
            assert gateway.poll(2000)
            return p.routing_reply_decoder.decode(gateway.recv())

        epoch = router.epoch  # new at each router start (in-flight re-declaration)
        assert ask(p.Route(1, "tiny")) == p.RouteReply(1, "r3", "http://x", epoch=epoch)
        assert ask(p.Route(2, "nope")) == p.RouteReply(2, error="no_replica")
        assert list_replicas(router.config.routing_bind)[0].in_flight == 1
        gateway.send(p.encode(p.Release("r3")))
        assert wait_for(lambda: list_replicas(router.config.routing_bind)[0].in_flight == 0)
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
        assert list_models(router.config.routing_bind) == []
    finally:
        sock.close(0)
