"""A router restart under traffic: right after its start the router has no replica yet (the
engines re-register at their next heartbeat). During `restart_grace_s` it answers
ROUTER_STARTING instead of no_replica, and a gateway's routing client asks again (or
routes on its last replica list) instead of failing the request (real sockets)."""

from __future__ import annotations

import asyncio
import threading

from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.routing_client import RoutingClient
from tests.routers import loopback_router_config, running_router
from tests.waiting import until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_no_replica_is_router_starting_only_during_the_grace() -> None:
    clock = Clock()
    with running_router(loopback_router_config(), clock=clock, restart_grace_s=6.0) as router:
        assert router.route(p.Route(1, "docs")).error == p.ROUTER_STARTING
        clock.now += 5.9
        assert router.route(p.Route(2, "docs")).error == p.ROUTER_STARTING
        clock.now += 0.2
        assert router.route(p.Route(3, "docs")).error == "no_replica"
    outcomes = {
        s.labels["outcome"]: s.value
        for m in router.metrics.routes.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert outcomes == {"routed": 0.0, p.ROUTER_STARTING: 2.0, "no_replica": 1.0}


def test_without_a_grace_no_replica_is_answered_at_once() -> None:
    with running_router(loopback_router_config()) as router:
        assert router.restart_grace_s == 0.0
        assert router.route(p.Route(1, "docs")).error == "no_replica"


def test_a_request_during_the_grace_waits_for_the_engine_to_re_register() -> None:
    config = loopback_router_config()
    with running_router(config, restart_grace_s=60.0):

        async def scenario() -> p.RouteReply:
            client = RoutingClient(config.routing_bind, timeout_s=30.0, view_refresh_s=0.05)
            await client.start()
            try:
                routed = asyncio.ensure_future(client.route("docs"))
                await asyncio.sleep(0.3)
                assert not routed.done()  # asking again, not failed
                agent = RegistryAgent(
                    config.registry_bind, p.Register("a", "docs", "http://127.0.0.1:9")
                )
                registered = threading.Thread(
                    target=lambda: (agent.register(), agent.process_replies(30.0))
                )
                registered.start()
                try:
                    await until("the request to be routed", routed.done)
                    return routed.result()
                finally:
                    registered.join()
                    agent.close()
            finally:
                await client.close()

        reply = asyncio.run(scenario())
    assert (reply.replica_id, reply.error) == ("a", "")
