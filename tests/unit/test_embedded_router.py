"""The router inside the gateway's process (gateway.embed_router, gateway/embedded_router.py)
against a real RouterServer on loopback sockets: its Routes are calls, counted in flight
like any gateway's and released at once; a LoRA adapter loads through the router's own
loop thread (its registry socket is that thread's alone); another gateway over the routing
socket (a second worker) shares the same view and load; stopping ends the router's thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import msgspec
import pytest

from hpcserve.config import ConfigError, PlatformConfig, RouterConfig, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.embedded_router import EmbeddedRouting
from hpcserve.gateway.routing_client import RoutingClient
from hpcserve.gateway.server import build_gateway_app
from hpcserve.router.adapters import AdapterCatalog, AdapterRouter, AdapterSource
from hpcserve.router.server import RouterServer
from hpcserve.stack import SERVICES, services
from tests.routers import loopback_router_config

REPLY_S = 30.0
SOURCES = [AdapterSource("docs-a", "llama", "/shared/docs-a", b'{"files": []}')]


def bound_router(config: RouterConfig) -> RouterServer:
    server = RouterServer(config, adapters=AdapterRouter(AdapterCatalog(lambda: SOURCES)))
    server.bind()
    return server


def test_routes_are_calls_counted_and_released_and_a_second_gateway_shares_the_view() -> None:
    config = loopback_router_config(lease_s=600.0)
    server = bound_router(config)
    routing = EmbeddedRouting(server, view_refresh_s=0.05)
    agent = RegistryAgent(
        config.registry_bind,
        p.Register("r1", "chat", "http://127.0.0.1:9", max_adapters=2, base_model="llama"),
    )
    loads: list[p.LoadAdapter] = []
    agent.on_load_adapter = loads.append

    async def scenario() -> None:
        await routing.start()
        other = RoutingClient(config.routing_bind, timeout_s=REPLY_S)  # a second worker
        await other.start()
        try:
            agent.register()
            await asyncio.to_thread(agent.process_replies, REPLY_S)
            assert agent.registered

            reply = await routing.route("chat")
            assert (reply.replica_id, reply.url, reply.error) == ("r1", "http://127.0.0.1:9", "")
            replica = server.registry.get("r1")
            assert replica is not None and replica.in_flight == 1
            # The other gateway sees the same replica, with the embedded gateway's request.
            listed = await other.replicas()
            assert [(r.replica_id, r.in_flight) for r in listed.replicas] == [("r1", 1)]
            assert (await other.route("chat")).replica_id == "r1"
            assert replica.in_flight == 2
            routing.release("r1", "chat")
            assert replica.in_flight == 1

            # The view the gateway reads between requests (prefix hints) follows the router.
            for _ in range(200):
                if routing.view.replicas_of("chat") == 1:
                    break
                await asyncio.sleep(0.02)
            assert routing.view.replicas_of("chat") == 1

            # An adapter nobody loaded: the LoadAdapter leaves by the router's thread.
            assert server._loop_thread != threading.get_ident()
            routing.adapter_wait_s = 0.0  # answer at once: adapter_loading
            assert (await routing.route("docs-a")).error == "adapter_loading"
            await asyncio.to_thread(agent.process_replies, REPLY_S)
            assert [(m.replica_id, m.adapter) for m in loads] == [("r1", "docs-a")]

            totals = await routing.sync_quota("gw-embedded", [p.TenantUsage("t", requests=3)])
            assert isinstance(totals, p.QuotaTotals)
            models = {m.id for m in (await routing.models()).models}
            assert {"chat", "docs-a"} <= models
        finally:
            await other.close()
            await routing.close()
            agent.close()

    asyncio.run(scenario())
    assert routing._thread is not None and not routing._thread.is_alive()


def test_a_route_to_a_model_without_replicas_is_answered_not_hung() -> None:
    server = bound_router(loopback_router_config())
    routing = EmbeddedRouting(server)

    async def scenario() -> p.RouteReply:
        await routing.start()
        try:
            return await routing.route("nobody-serves-this")
        finally:
            await routing.close()

    reply = asyncio.run(scenario())
    assert (reply.replica_id, reply.error) == ("", "no_replica")


def test_the_stack_starts_no_router_process_when_the_gateway_embeds_it(tmp_path) -> None:
    plain = PlatformConfig(state_dir=str(tmp_path))
    embedded = msgspec.structs.replace(
        plain, gateway=msgspec.structs.replace(plain.gateway, embed_router=True)
    )
    assert services(plain) == SERVICES
    assert services(embedded) == ("gateway", "poolmgr", "batch-runner")


def test_the_setting_is_read_from_the_config_and_needs_a_router_to_embed(tmp_path) -> None:
    config = parse_config({"state_dir": str(tmp_path), "gateway": {"embed_router": True}})
    assert config.gateway.embed_router
    with pytest.raises(ConfigError, match="embed_router"):
        build_gateway_app(config, None, None)


@contextlib.asynccontextmanager
async def one_replica() -> AsyncIterator[tuple[RouterServer, EmbeddedRouting]]:
    """A started EmbeddedRouting whose router has replica r1 of model chat registered."""
    config = loopback_router_config(lease_s=600.0)
    server = bound_router(config)
    routing = EmbeddedRouting(server)
    agent = RegistryAgent(config.registry_bind, p.Register("r1", "chat", "http://127.0.0.1:9"))
    await routing.start()
    try:
        agent.register()
        await asyncio.to_thread(agent.process_replies, REPLY_S)
        yield server, routing
    finally:
        await routing.close()
        agent.close()


def test_routes_of_one_loop_iteration_are_decided_together_and_a_gone_one_is_released() -> None:
    async def scenario() -> None:
        async with one_replica() as (server, routing):
            replica = server.registry.get("r1")
            assert replica is not None
            replies = await asyncio.gather(*(routing.route("chat") for _ in range(8)))
            assert [r.replica_id for r in replies] == ["r1"] * 8
            assert replica.in_flight == 8
            # A request that gives up (its client went away) before its decision ran: the
            # decision is made with the others, and released at once.
            task = asyncio.create_task(routing.route("chat"))
            await asyncio.sleep(0)  # the task waits for its decision now
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert replica.in_flight == 8

    asyncio.run(scenario())


def test_a_route_alone_is_decided_in_its_call_and_one_beside_others_with_the_batch() -> None:
    async def scenario() -> None:
        async with one_replica() as (server, routing):
            # Nothing routed is in flight (concurrency 1): no batch to wait for.
            alone = routing._decided(p.Route(1, "chat"))
            assert alone.done() and alone.result().replica_id == "r1"
            # With it in flight, the next waits for its iteration's batch.
            beside = routing._decided(p.Route(2, "chat"))
            assert not beside.done()
            assert (await beside).replica_id == "r1"
            routing.release("r1", "chat")
            routing.release("r1", "chat")
            again = routing._decided(p.Route(3, "chat"))
            assert again.done(), "both released: alone again"
            routing.release("r1", "chat")
            replica = server.registry.get("r1")
            assert replica is not None and replica.in_flight == 0
            # A Route that finds no replica leaves nothing in flight.
            assert routing._decided(p.Route(4, "nobody")).result().replica_id == ""
            assert routing._decided(p.Route(5, "chat")).done()

    asyncio.run(scenario())


class FailingRouter:
    """An EmbeddableRouter whose loop fails at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.epoch = "e"

    def serve_forever(self) -> None:
        self.ready.set()
        raise RuntimeError("the poller broke")

    def stop(self) -> None:
        pass

    def handle(self, msg: p.RoutingMessage, peer: bytes = b"") -> p.RoutingReply | None:
        return p.ReplicaList(getattr(msg, "request_id", 0))


def test_a_router_thread_that_fails_stops_the_gateway_process() -> None:
    import signal

    stopped = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        routing = EmbeddedRouting(FailingRouter())  # type: ignore[arg-type]

        async def scenario() -> None:
            await routing.start()
            await routing.close()

        asyncio.run(scenario())
        assert stopped.wait(10), "no SIGTERM after the router's thread failed"
    finally:
        signal.signal(signal.SIGTERM, previous)


class RouterWithABug(FailingRouter):
    """Serves, but its decision raises."""

    def serve_forever(self) -> None:
        self.ready.set()

    def handle(self, msg: p.RoutingMessage, peer: bytes = b"") -> p.RoutingReply | None:
        if isinstance(msg, p.Route):
            raise KeyError("a bug")
        return super().handle(msg, peer)


def test_a_decision_that_raises_fails_its_request_and_no_other() -> None:
    from hpcserve.gateway.routing_client import RouterUnavailable

    routing = EmbeddedRouting(RouterWithABug())  # type: ignore[arg-type]

    async def scenario() -> list[object]:
        await routing.start()
        try:
            return await asyncio.gather(
                routing.route("chat"), routing.route("chat"), return_exceptions=True
            )
        finally:
            await routing.close()

    outcomes = asyncio.run(scenario())
    assert [type(o) for o in outcomes] == [RouterUnavailable, RouterUnavailable]
