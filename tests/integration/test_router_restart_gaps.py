"""A router restart, seen from a gateway's routing client (real routers, real sockets): the
requests in flight are counted again by the new router (per replica and per LoRA adapter),
and an alias keeps routing on the last alias map while no router answers."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path

from hpcserve.config import RouterConfig
from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.routing_client import RoutingClient
from hpcserve.router.aliases import AliasCatalog, AliasRouter
from hpcserve.router.server import RouterServer
from tests.routers import (
    alias_registry,
    loopback_router_config,
    ports_free,
    running_router,
)
from tests.waiting import until

REPLICA = p.Register(
    "a", "docs", "http://127.0.0.1:9", model_ref="docs@1", adapters=["docs-a"], max_adapters=2
)


# Out of reach while a router runs (a thread of this process, which may be descheduled for
# seconds); short only while no router is there, for the fallback on the last known set.
UNREACHED_S = 60.0
AWAY_S = 0.5


def start(stack: ExitStack, config: RouterConfig, registry_db: Path) -> RouterServer:
    aliases = AliasRouter(AliasCatalog.from_registry(str(registry_db)))
    router = stack.enter_context(running_router(config, aliases=aliases))
    agent = RegistryAgent(config.registry_bind, REPLICA)  # the engine (re-)registers
    stack.callback(agent.close)
    agent.register()
    agent.process_replies(30.0)
    assert agent.registered
    return router


def counts(router: RouterServer) -> tuple[int, int]:
    replica = router.registry.get("a")
    return (replica.in_flight if replica else -1), router.adapters.in_flight("a", "docs-a")


def test_in_flight_requests_are_re_declared_and_aliases_route_while_the_router_is_away(
    tmp_path: Path,
) -> None:
    config = loopback_router_config(lease_s=600.0)
    registry_db = alias_registry(tmp_path)  # alias extraction -> docs@1

    async def scenario() -> None:
        client = RoutingClient(config.routing_bind, timeout_s=UNREACHED_S, view_refresh_s=0.05)
        await client.start()
        try:
            with ExitStack() as first:
                router = start(first, config, registry_db)
                routed = [await client.route(m) for m in ("docs", "docs", "docs-a")]
                assert [r.replica_id for r in routed] == ["a"] * 3
                assert counts(router) == (3, 1)
                await until("the alias map", lambda: client.view.served_as("extraction") == "docs")
                old_epoch = client.epoch
            await until("the ports to be free", lambda: ports_free(config))

            # No router: the last known set serves, an alias by its target's served name.
            client.timeout_s = AWAY_S
            fallback = await client.route("extraction")
            assert (fallback.replica_id, fallback.model) == ("a", "docs")
            client.release("a", "extraction")  # finished before any router counted it
            client.timeout_s = UNREACHED_S

            with ExitStack() as second:
                router = start(second, config, registry_db)
                await until("the in-flight requests re-declared", lambda: counts(router) == (3, 1))
                assert client.epoch not in ("", old_epoch)
                again = await client.route("docs")  # the new router's own: counted once
                assert again.epoch == client.epoch and counts(router) == (4, 1)
                for model in ("docs", "docs", "docs-a", "docs"):
                    client.release("a", model)
                await until("every request released", lambda: counts(router) == (0, 0))
        finally:
            await client.close()

    asyncio.run(scenario())
