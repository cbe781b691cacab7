"""The executor a batch runner uses outside any gateway (gateway/batch/execute.py
RoutedExecutor, what `hpcserve batch-runner` builds): a real router on loopback, a real
simulated engine registered with it, and a replica whose address refuses connections.
Each outcome the runner acts on: an engine's answer (final, any status), a failed replica
(retried elsewhere), no replica (wait), a model nobody configured (404 at once)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from hpcserve.contracts import protocol as p
from hpcserve.contracts.cache_salt import salted_body, tenant_salt
from hpcserve.contracts.router_client import list_replicas
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.batch.execute import NoReplica, ReplicaFailed, RoutedExecutor
from hpcserve.gateway.batch.runner import result_of
from hpcserve.gateway.relay import Relay
from hpcserve.gateway.routing_client import RoutingClient
from hpcserve.router.aliases import AliasCatalog, AliasRouter
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import alias_registry, loopback_router_config, running_router
from tests.services import service, sim_engine_argv

CHAT = msgspec.json.encode(
    {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "an invoice"}]}
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[RouterServer]:
    """Replica "live" (a simulated engine) and "dead" (nothing listens) of model "sim"."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        service(sim_engine_argv(port, "sim", 0.1), url),
        running_router(loopback_router_config(lease_s=600.0)) as router,
    ):
        agents = [
            RegistryAgent(router.config.registry_bind, p.Register("live", "sim", url)),
            RegistryAgent(
                router.config.registry_bind,
                p.Register("dead", "sim", f"http://127.0.0.1:{free_port()}"),
            ),
        ]
        try:
            for agent in agents:
                agent.register()
            wait_for(
                "both replicas to register",
                lambda: len(list_replicas(router.config.routing_bind)) == 2,
                timeout=30,
            )
            yield router
        finally:
            for agent in agents:
                agent.close()


def run(router: RouterServer, scenario, isolate: bool = False) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        routing = RoutingClient(router.config.routing_bind, timeout_s=10.0)
        relay = Relay(upstream_timeout_s=30.0)
        await routing.start()
        await relay.start()
        try:
            executor = RoutedExecutor(
                routing,
                relay,
                route_hints=None,
                configured_models={"sim", "idle"},
                isolate_tenant_caches=isolate,
            )
            await scenario(executor)
        finally:
            await relay.close()
            await routing.close()

    asyncio.run(main())


def test_an_engine_answer_comes_back_final_with_its_replica(fleet: RouterServer) -> None:
    async def scenario(executor: RoutedExecutor) -> None:
        reply = await executor.execute(
            "sim", "/v1/chat/completions", CHAT, "req_1", exclude=["dead"], hints={}
        )
        assert (reply.status_code, reply.replica_id) == (200, "live")
        answer = msgspec.json.decode(reply.body)
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] == 3
        assert await executor.route_hints("sim", "/v1/chat/completions", CHAT) == {}

    run(fleet, scenario)


def test_a_replica_that_refuses_is_a_failure_naming_it(fleet: RouterServer) -> None:
    async def scenario(executor: RoutedExecutor) -> None:
        with pytest.raises(ReplicaFailed) as failed:
            await executor.execute(
                "sim", "/v1/chat/completions", CHAT, "req_2", exclude=["live"], hints={}
            )
        assert failed.value.replica_id == "dead"

    run(fleet, scenario)


def test_no_replica_waits_and_an_unknown_model_is_a_404(fleet: RouterServer) -> None:
    async def scenario(executor: RoutedExecutor) -> None:
        with pytest.raises(NoReplica, match="no replica of 'idle'"):
            await executor.execute(
                "idle", "/v1/chat/completions", CHAT, "req_3", exclude=[], hints={}
            )
        reply = await executor.execute(
            "nope", "/v1/chat/completions", CHAT, "req_4", exclude=[], hints={}
        )
        assert reply.status_code == 404
        assert msgspec.json.decode(reply.body)["error"]["code"] == "model_not_found"

    run(fleet, scenario)


def test_a_responses_line_runs_as_a_chat_completion_and_answers_a_response(
    fleet: RouterServer,
) -> None:
    body = msgspec.json.encode({"model": "sim", "input": "an invoice", "max_output_tokens": 3})

    async def scenario(executor: RoutedExecutor) -> None:
        reply = await executor.execute(
            "sim", "/v1/responses", body, "req_r", exclude=["dead"], hints={}
        )
        assert (reply.status_code, reply.replica_id) == (200, "live")
        answer = msgspec.json.decode(reply.body)
        assert (answer["object"], answer["status"], answer["store"]) == (
            "response",
            "incomplete",
            False,
        )
        assert answer["output"][0]["content"][0]["text"] == " tok0 tok1 tok2"
        assert answer["usage"]["output_tokens"] == 3
        result = result_of(1, "c", "req_r", reply)  # what the batch's token counts read
        assert (result.input_tokens, result.output_tokens) == (2, 3)

    run(fleet, scenario)


def test_a_line_for_an_alias_reaches_its_versions_replica_under_its_served_name(
    tmp_path: Path,
) -> None:
    """The engine knows a version by its served name, not the alias (vLLM and the simulator
    answer 404 to any other name); the reply names the version for the usage record."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    catalog = AliasCatalog.from_registry(str(alias_registry(tmp_path)), refresh_s=0.0)
    with (
        service(sim_engine_argv(port, "docs-v1", 0.1), url),
        running_router(
            loopback_router_config(lease_s=600.0), aliases=AliasRouter(catalog)
        ) as router,
    ):
        agent = RegistryAgent(
            router.config.registry_bind, p.Register("v1", "docs-v1", url, model_ref="docs@1")
        )
        try:
            agent.register()
            wait_for(
                "the replica to register",
                lambda: len(list_replicas(router.config.routing_bind)) == 1,
                timeout=30,
            )
            body = msgspec.json.encode(
                {
                    "model": "extraction",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "x"}],
                }
            )

            async def scenario(executor: RoutedExecutor) -> None:
                reply = await executor.execute(
                    "extraction", "/v1/chat/completions", body, "req_a", exclude=[], hints={}
                )
                assert (reply.status_code, reply.replica_id) == (200, "v1"), reply.body
                assert (reply.version, reply.adapter) == ("docs@1", "")
                assert msgspec.json.decode(reply.body)["model"] == "docs-v1"

            run(router, scenario)
        finally:
            agent.close()


def _live_hits(router: RouterServer) -> float:
    import httpx

    (live,) = [r for r in list_replicas(router.config.routing_bind) if r.replica_id == "live"]
    for line in httpx.get(live.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:prefix_cache_hits_total")


def test_a_batch_line_carries_its_tenants_cache_salt(fleet: RouterServer) -> None:
    """As the gateway's interactive requests do: a line shares cached prefixes with its own
    tenant's requests only, whatever cache_salt the line itself names."""
    prompt = msgspec.json.encode(
        {"model": "sim", "max_tokens": 1, "prompt": "A batch of one tenant's documents. " * 40}
    )

    async def scenario(executor: RoutedExecutor) -> None:
        async def hits(tenant: str, body: bytes = prompt) -> float:
            before = _live_hits(fleet)
            reply = await executor.execute(
                "sim", "/v1/completions", body, "req", exclude=["dead"], hints={}, tenant=tenant
            )
            assert reply.status_code == 200, reply.body
            return _live_hits(fleet) - before

        await hits("team-a")
        assert await hits("team-a") > 0
        assert await hits("team-b") == 0
        other = msgspec.json.decode(prompt) | {"cache_salt": tenant_salt("team-a")}
        assert await hits("team-c", msgspec.json.encode(other)) == 0

    run(fleet, scenario, isolate=True)


@pytest.mark.parametrize(
    ("body", "replace", "expected"),
    [
        (b'{"model":"m"}', False, {"model": "m", "cache_salt": "s"}),
        (b'{"model":"m"}  \n', False, {"model": "m", "cache_salt": "s"}),
        (b"{}", False, {"cache_salt": "s"}),
        (b'{"cache_salt":"theirs","model":"m"}', True, {"model": "m", "cache_salt": "s"}),
    ],
)
def test_the_salt_goes_last_in_the_body(body: bytes, replace: bool, expected: dict) -> None:
    out = salted_body(body, "s", replace=replace)
    assert msgspec.json.decode(out) == expected
    assert out.rstrip().endswith(b'"cache_salt":"s"}')
    assert out.count(b"cache_salt") == 1
