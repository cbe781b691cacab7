"""Overflow on a queue budget, end to end: a real router, a real engine agent
(`hpcserve engine --engine sim`, one request at a time, slow) reporting its load, the real
gateway app, and a second simulated engine standing in for the external API. A tenant that
may overflow goes external once the replica would queue it past its budget; a data-resident
tenant queues at the replica instead."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, ExternalAPIConfig, GatewayConfig, TenantConfig, hash_api_key
from hpcserve.contracts.router_client import list_models, replica_list
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import loopback_router_config, running_router
from tests.services import service, sim_engine_argv

MODEL = "tiny"
TENANTS = [
    TenantConfig(name="bursty", overflow="external", queue_budget_s=0.3),
    TenantConfig(name="resident", data_resident=True),
    TenantConfig(name="open"),
]


def chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }


def engine_running(url: str) -> float:
    """The engine's own `vllm:num_requests_running`."""
    text = httpx.get(url + "/metrics", timeout=5).text
    name = "vllm:num_requests_running"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{tenant}"}


@pytest.fixture
def router_metrics() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def router(router_metrics: CollectorRegistry) -> Iterator[RouterServer]:
    with running_router(loopback_router_config(), metrics_registry=router_metrics) as server:
        yield server


@pytest.fixture
def slow_engine(router: RouterServer) -> Iterator[None]:
    with engine_process(router):
        yield


@contextmanager
def engine_process(router: RouterServer) -> Iterator[None]:
    """One replica that runs one request at a time, 20 ms per token, heartbeat every 0.25 s."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "sim",
         "--model-path", "/nonexistent", "--served-model-name", MODEL, "--pool", MODEL,
         "--router", router.config.registry_bind, "--bind-host", "127.0.0.1",
         "--advertise-host", "127.0.0.1", "--heartbeat-s", "0.25", "--drain-s", "10",
         "--", "--decode-ms-per-token", "20", "--max-num-seqs", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for("the engine to register", lambda: list_models(router.config.routing_bind))
        yield
    finally:
        if proc.poll() is None:
            proc.kill()  # the simulated engine gets SIGTERM through PR_SET_PDEATHSIG
        proc.wait(10)


@pytest.fixture
def external() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(sim_engine_argv(port, "ext-model", 1), url):
        yield url


def test_over_the_queue_budget_overflows_if_allowed_and_queues_if_data_resident(
    router: RouterServer,
    router_metrics: CollectorRegistry,
    slow_engine: None,
    external: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EXT_KEY", "sk-external")
    config = GatewayConfig(
        api_keys=[ApiKey(tenant=t.name, sha256=hash_api_key(f"sk-{t.name}")) for t in TENANTS],
        tenants=TENANTS,
        overflow=ExternalAPIConfig(
            base_url=external + "/v1", api_key_env="EXT_KEY", models={MODEL: "ext-model"}
        ),
    )
    gateway = Gateway(
        config, routing_endpoint=router.config.routing_bind, configured_models={MODEL}
    )
    with TestClient(build_app(gateway)) as client, ThreadPoolExecutor(4) as pool:

        def post(tenant: str, max_tokens: int) -> dict[str, object]:
            response = client.post(
                "/v1/chat/completions", json=chat(max_tokens), headers=auth(tenant)
            )
            assert response.status_code == 200, response.text
            return response.json()

        # Idle replica: a tenant that may overflow is served here.
        assert post("bursty", 2)["model"] == MODEL
        # One request runs (~3 s: the queue is still there however long this process is
        # descheduled before the next post), a short one waits behind it; the engine reports
        # the queue.
        started = time.monotonic()
        (replica,) = router.registry
        running = [pool.submit(post, "open", 150)]
        # Asked of the engine, not of the router's view: a heartbeat taken while the request
        # above ran (one every 0.25 s) would pass for this one running, and the short one
        # below would go first.
        wait_for("the long request to run", lambda: engine_running(replica.spec.url) >= 1)
        running.append(pool.submit(post, "open", 2))
        wait_for("the engine to report a queue", lambda: replica.load.waiting >= 1)
        # Nothing has completed for 0.4 s: the router reckons each completion takes as long.
        time.sleep(max(0.0, started + 0.4 - time.monotonic()))

        overflowed = post("bursty", 2)
        assert overflowed["model"] == "ext-model"
        routes = 'hpcserve_router_routes_total{outcome="over_queue_budget"}'
        assert sample(generate_latest(router_metrics).decode(), routes) == 1
        # A data-resident tenant never leaves: it queues here and is served when its turn comes.
        resident = pool.submit(post, "resident", 2)
        assert resident.result(timeout=120)["model"] == MODEL
        assert [f.result(timeout=120)["model"] for f in running] == [MODEL, MODEL]
        overflow = 'hpcserve_gateway_overflow_total{model="tiny",tenant="bursty"}'
        assert metric(client, overflow) == 1
        assert metric(client, overflow.replace("bursty", "resident")) == 0
        # Idle again: the tenant that may overflow is served here.
        wait_for("the engine to report idle", lambda: replica.load.running == 0)
        assert post("bursty", 2)["model"] == MODEL


def test_a_model_at_zero_overflows_if_allowed_else_is_held_until_served_or_503(
    router: RouterServer,
    router_metrics: CollectorRegistry,
    external: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool scaled to zero (no replica; pools[].autoscale.min = 0): a tenant that may
    overflow goes external at once; anyone else is held up to the wake budget, served when a
    replica registers meanwhile, else answered 503 with Retry-After. Every one of their
    Routes is unserved demand, which is what the pool manager wakes the pool on."""
    monkeypatch.setenv("EXT_KEY", "sk-external")
    config = GatewayConfig(
        api_keys=[ApiKey(tenant=t.name, sha256=hash_api_key(f"sk-{t.name}")) for t in TENANTS],
        tenants=TENANTS,
        overflow=ExternalAPIConfig(
            base_url=external + "/v1", api_key_env="EXT_KEY", models={MODEL: "ext-model"}
        ),
    )

    def gateway(budget_s: float) -> Gateway:
        made = Gateway(
            config, routing_endpoint=router.config.routing_bind, configured_models={MODEL}
        )
        made.wake_budgets = {MODEL: budget_s}  # as gateway/server.py sets it from the pools
        return made

    with TestClient(build_app(gateway(0.5))) as client:
        overflowed = client.post("/v1/chat/completions", json=chat(2), headers=auth("bursty"))
        assert overflowed.status_code == 200 and overflowed.json()["model"] == "ext-model"
        assert MODEL in replica_list(router.config.routing_bind).unserved
        refused = client.post("/v1/chat/completions", json=chat(2), headers=auth("resident"))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "model_starting"
        holds = 'hpcserve_gateway_wake_holds_total{model="tiny",outcome="timeout"}'
        assert metric(client, holds) == 1
    with TestClient(build_app(gateway(120))) as client, ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.post, "/v1/chat/completions", json=chat(2), headers=auth("open"))
        routes = 'hpcserve_router_routes_total{outcome="no_replica"}'
        before = sample(generate_latest(router_metrics).decode(), routes)
        wait_for(
            "the held request to ask again",
            lambda: sample(generate_latest(router_metrics).decode(), routes) >= before + 2,
        )
        assert not held.done()
        with engine_process(router):
            reply = held.result(timeout=120)
            assert reply.status_code == 200 and reply.json()["model"] == MODEL, reply.text
        assert metric(client, holds.replace("timeout", "served")) == 1


def sample(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def metric(client: TestClient, line_start: str) -> float:
    return sample(client.get("/metrics").text, line_start)
