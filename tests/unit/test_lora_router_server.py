"""On-demand LoRA through the real router over real ZeroMQ: a Route for an adapter nobody has
loaded makes the router send LoadAdapter to the engine agent, answers `adapter_loading`
until the agent reports AdapterLoaded, then routes to that replica; /v1/models material
(ListModels) lists adapters with their parent."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from hpcserve.contracts import protocol as p
from hpcserve.contracts.router_client import list_models
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.router.adapters import AdapterCatalog, AdapterRouter, AdapterSource
from hpcserve.router.server import RouterServer
from tests.routers import loopback_router_config, running_router

SOURCES = [AdapterSource("docs-a", "llama", "/shared/docs-a", b'{"files": []}')]
# The router answers from a thread of this process: waits end at the reply, and neither they
# nor the agents' leases (no heartbeats here) run out if this process is descheduled.
REPLY_S = 30.0
LEASE_S = 600.0


@pytest.fixture
def lora_router() -> Iterator[RouterServer]:
    config = loopback_router_config(lease_s=LEASE_S)
    adapters = AdapterRouter(AdapterCatalog(lambda: SOURCES))
    with running_router(config, adapters=adapters) as server:
        yield server


def route(sock: zmq.Socket, model: str, request_id: int) -> p.RouteReply:
    sock.send(p.encode(p.Route(request_id, model)))
    assert sock.poll(int(REPLY_S * 1000)), "the router did not answer"
    reply = p.routing_reply_decoder.decode(sock.recv())
    assert isinstance(reply, p.RouteReply)
    return reply


@contextmanager
def agent_and_gateway(
    server: RouterServer, registration: p.Register
) -> Iterator[tuple[RegistryAgent, list[p.LoadAdapter], zmq.Socket]]:
    """An engine agent registered with `server` (the LoadAdapters it is asked for are
    collected) and a gateway's DEALER on the routing socket."""
    agent = RegistryAgent(server.config.registry_bind, registration)
    asked: list[p.LoadAdapter] = []
    agent.on_load_adapter = asked.append
    gateway = zmq.Context.instance().socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.connect(server.config.routing_bind)
    try:
        agent.register()
        agent.process_replies(REPLY_S)
        assert agent.registered
        yield agent, asked, gateway
    finally:
        gateway.close(0)
        agent.close()


def test_an_adapter_is_loaded_on_demand_then_routed_to(lora_router: RouterServer) -> None:
    registration = p.Register(
        "r1", "chat", "http://127.0.0.1:9", max_adapters=2, base_model="llama"
    )
    with agent_and_gateway(lora_router, registration) as (agent, asked, gateway):
        listed = {
            m.id: (m.replicas, m.parent) for m in list_models(lora_router.config.routing_bind)
        }
        assert listed == {"chat": (1, ""), "docs-a": (0, "chat")}

        assert route(gateway, "docs-a", 1).error == "adapter_loading"
        agent.process_replies(REPLY_S)
        assert [(m.replica_id, m.adapter, m.source) for m in asked] == [
            ("r1", "docs-a", "/shared/docs-a")
        ]
        assert route(gateway, "docs-a", 2).error == "adapter_loading"  # no second load
        agent.send(p.AdapterLoaded("r1", "docs-a", adapters=["docs-a"]))
        agent.heartbeat(p.ReplicaLoad(), ["docs-a"])
        agent.process_replies(REPLY_S)  # the heartbeat's ack
        reply = route(gateway, "docs-a", 3)
        assert (reply.replica_id, reply.url, reply.error) == ("r1", "http://127.0.0.1:9", "")
        assert len(asked) == 1
        assert route(gateway, "no-such-adapter", 4).error == "no_replica"
        listed = {
            m.id: (m.replicas, m.parent) for m in list_models(lora_router.config.routing_bind)
        }
        assert listed["docs-a"] == (1, "chat")


def test_a_release_naming_the_adapter_lets_only_idle_adapters_be_unloaded() -> None:
    """docs-a is the least recently routed but still has a request in flight; docs-b's
    request was released (folded into the next Route): docs-b makes room for docs-c."""
    sources = [
        AdapterSource(name, "llama", f"/shared/{name}", b'{"files": []}')
        for name in ("docs-a", "docs-b", "docs-c")
    ]
    adapters = AdapterRouter(AdapterCatalog(lambda: sources))
    with running_router(loopback_router_config(lease_s=LEASE_S), adapters=adapters) as server:
        registration = p.Register(
            "r1",
            "chat",
            "http://127.0.0.1:9",
            adapters=["docs-a", "docs-b"],
            max_adapters=2,
            base_model="llama",
        )
        with agent_and_gateway(server, registration) as (agent, asked, gateway):
            assert route(gateway, "docs-a", 1).replica_id == "r1"  # stays in flight
            assert route(gateway, "docs-b", 2).replica_id == "r1"
            gateway.send(
                p.encode(p.Route(3, "docs-c", released=["r1"], released_models=["docs-b"]))
            )
            assert gateway.poll(int(REPLY_S * 1000))
            assert p.routing_reply_decoder.decode(gateway.recv()).error == "adapter_loading"
            agent.process_replies(REPLY_S)
            assert [(m.adapter, m.unload) for m in asked] == [("docs-c", ["docs-b"])]
