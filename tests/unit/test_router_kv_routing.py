"""The router process end to end over real ZeroMQ: a replica registers its KV-event
endpoint, the router subscribes, and Route messages with prompt hashes go where the
blocks are; Release folded into Route drops the in-flight count."""

from __future__ import annotations

import time

import pytest
import zmq

from hpcserve.config import RoutingConfig
from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts import protocol as p
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.contracts.router_client import list_replicas
from hpcserve.engine_launch.agent import RegistryAgent
from tests.ports import free_port
from tests.routers import loopback_router_config, running_router

BS = 16
DOC = list(range(1000, 1000 + 8 * BS))


@pytest.fixture
def router():
    # Ten requests in a row to one of three replicas: past the share gate, which
    # tests/unit/test_policy_routing.py covers. No lease lapses while the test runs, however
    # long this process (router thread and agents alike) is descheduled.
    config = loopback_router_config(routing=RoutingConfig(max_share=1.0), lease_s=600.0)
    with running_router(config) as server:
        yield server


def ask(sock, msg):
    sock.send(p.encode(msg))
    assert sock.poll(30_000)
    return p.routing_reply_decoder.decode(sock.recv())


def route(sock, tokens, **extra):
    return ask(
        sock,
        p.Route(
            1,
            "m",
            block_hashes=prompt_block_hashes(tokens, BS),
            block_size=BS,
            prompt_tokens=len(tokens),
            **extra,
        ),
    )


def test_routes_follow_the_kv_events_a_replica_publishes(router):
    pub_port, replay_port = free_port(), free_port()
    publisher = kw.KVEventPublisher(
        f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}", topic="hot"
    )
    agents = [
        RegistryAgent(
            router.config.registry_bind,
            p.Register(
                rid,
                "m",
                f"http://{rid}",
                block_size=BS,
                kv_events_endpoint=f"tcp://127.0.0.1:{pub_port}" if rid == "hot" else "",
                kv_replay_endpoint=f"tcp://127.0.0.1:{replay_port}" if rid == "hot" else "",
                kv_events_topic=rid,
            ),
        )
        for rid in ("hot", "cold1", "cold2")
    ]
    gateway = zmq.Context.instance().socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    try:
        for agent in agents:
            agent.register()
            agent.process_replies(30.0)
            assert agent.registered
        gateway.connect(router.config.routing_bind)
        stored = kw.BlockStored([b"h%d" % i for i in range(8)], None, DOC, BS)
        hashes = prompt_block_hashes(DOC, BS)
        deadline = time.monotonic() + 60
        # PUB drops until the router's subscription lands: publish until the index has it.
        while router.decider.index.match(hashes).get("hot") != 8:
            assert time.monotonic() < deadline, "the router never indexed the blocks"
            publisher.publish([stored])
            time.sleep(0.05)
        for _ in range(10):
            reply = route(gateway, DOC)
            assert reply.replica_id == "hot"
            ask(gateway, p.Route(2, "other", released=[reply.replica_id]))
        assert all(r.in_flight == 0 for r in list_replicas(router.config.routing_bind))
        # The engine evicts the blocks: the prefix stops attracting traffic.
        publisher.publish([kw.BlockRemoved([b"h%d" % i for i in range(8)])])
        seen = set()
        deadline = time.monotonic() + 60
        while not seen & {"cold1", "cold2"} and time.monotonic() < deadline:
            reply = route(gateway, DOC)
            seen.add(reply.replica_id)
            ask(gateway, p.Route(2, "other", released=[reply.replica_id]))
        assert seen & {"cold1", "cold2"}
    finally:
        gateway.close(0)
        for agent in agents:
            agent.close()
        publisher.close()
