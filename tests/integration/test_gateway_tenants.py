"""The real gateway app (in-process) with a real router and real simulated engines over HTTP:
tenant limits (also across two gateways), usage counting, failover, overflow, tracing."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.testclient import TestClient

from hpcserve.config import (
    ApiKey,
    ExternalAPIConfig,
    GatewayConfig,
    TenantConfig,
    hash_api_key,
)
from hpcserve.contracts import protocol as p
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.gateway.tracing import Tracing
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import count_quota_reports_once_complete
from tests.services import gateways, sim_engine_argv, wait_healthy

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
TENANTS = {
    "free": TenantConfig(name="free", requests_per_min=4),
    "metered": TenantConfig(name="metered", tokens_per_min=20),
    "narrow": TenantConfig(name="narrow", allowed_models=["other"]),
    "single": TenantConfig(name="single", max_concurrent=1),
    "bursty": TenantConfig(name="bursty", overflow="external", priority="batch"),
    "resident": TenantConfig(name="resident", data_resident=True),
    "open": TenantConfig(name="open"),
}


def key(tenant: str) -> str:
    return f"sk-{tenant}"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key(tenant)}"}


class SimEngine:
    def __init__(self, name: str, decode_ms: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            sim_engine_argv(self.port, name, decode_ms),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_healthy(self.url, self.proc)
        except AssertionError:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGKILL: an engine dying mid-request, not one draining."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, SimEngine]]:
    started = {
        "fast": SimEngine(MODEL, 1),
        "slow": SimEngine(MODEL, 50),
        "external": SimEngine("ext-model", 1),
    }
    yield started
    for engine in started.values():
        engine.stop()


def make_gateway(router: RouterServer, **overrides: object) -> Gateway:
    config = GatewayConfig(
        api_keys=[ApiKey(tenant=t, sha256=hash_api_key(key(t))) for t in TENANTS],
        tenants=list(TENANTS.values()),
        quota_sync_s=0.05,
        route_timeout_s=60.0,  # the router (a thread here) answers however loaded the machine
        **overrides,  # type: ignore[arg-type]
    )
    return Gateway(config, routing_endpoint=router.config.routing_bind, configured_models={MODEL})


def register(router: RouterServer, replica_id: str, url: str, waiting: int = 0) -> None:
    load = p.ReplicaLoad(waiting=waiting)
    router.registry.register(p.Register(replica_id, MODEL, url, load=load), now=1e12)


@pytest.fixture
def client(router: RouterServer, engines: dict[str, SimEngine]) -> Iterator[TestClient]:
    register(router, "fast", engines["fast"].url)
    with TestClient(build_app(make_gateway(router))) as client:
        yield client


def metric(client: TestClient, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_requests_per_minute_is_a_429_with_retry_after(client: TestClient) -> None:
    statuses = [
        client.post("/v1/chat/completions", json=CHAT, headers=auth("free")).status_code
        for _ in range(4)
    ]
    assert statuses == [200] * 4
    response = client.post("/v1/chat/completions", json=CHAT, headers=auth("free"))
    assert response.status_code == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests_per_min" in error["message"]
    # Another tenant is not affected.
    assert client.post("/v1/chat/completions", json=CHAT, headers=auth("open")).status_code == 200


def test_bad_input_and_unknown_models_count_nothing(client: TestClient) -> None:
    for body in (
        {"model": MODEL},
        {"model": MODEL, "messages": [], "n": -1},
        b"{",
        CHAT | {"n": 0},
    ):
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = client.post("/v1/chat/completions", headers=auth("free"), **kwargs)
        assert response.status_code == 400
    unknown = CHAT | {"model": "nope"}
    for _ in range(5):
        response = client.post("/v1/chat/completions", json=unknown, headers=auth("free"))
        assert response.status_code == 404
    statuses = [
        client.post("/v1/chat/completions", json=CHAT, headers=auth("free")).status_code
        for _ in range(5)
    ]
    assert statuses == [200, 200, 200, 200, 429]


def test_tokens_per_minute_counts_streamed_usage_the_client_did_not_ask_for(
    client: TestClient,
) -> None:
    body = CHAT | {"stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth("metered")) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    # The gateway asked the engine for usage; the client, who did not, never sees it.
    assert not any('"usage"' in e for e in events)
    tokens = 'hpcserve_gateway_tokens_total{direction="%s",model="tiny",tenant="metered"}'
    assert metric(client, tokens % "out") == 5
    # Admitted while under 20 tokens (prompt + completion, from the engine's usage), then 429.
    for _ in range(20):
        used = metric(client, tokens % "in") + metric(client, tokens % "out")
        response = client.post("/v1/chat/completions", json=CHAT, headers=auth("metered"))
        if used >= 20:
            break
        assert response.status_code == 200
    assert used >= 20 and response.status_code == 429
    assert "tokens_per_min" in response.json()["error"]["message"]


def test_a_client_asking_for_usage_gets_it(client: TestClient) -> None:
    body = CHAT | {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth("open")) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = msgspec.json.decode(events[-1][6:])["usage"]
    assert usage["completion_tokens"] == 5


def test_allowed_models_is_a_403(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json=CHAT, headers=auth("narrow"))
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "model_not_allowed" and error["param"] == "model"


def test_max_concurrent(router: RouterServer, engines: dict[str, SimEngine]) -> None:
    register(router, "slow", engines["slow"].url)
    with TestClient(build_app(make_gateway(router))) as client:
        # ~20 s on the slow engine: still running however long this process is descheduled
        # before the second request (the first is cancelled when its stream is closed)
        body = CHAT | {"stream": True, "max_tokens": 400}
        with client.stream("POST", "/v1/chat/completions", json=body, headers=auth("single")):
            second = client.post("/v1/chat/completions", json=CHAT, headers=auth("single"))
            assert second.status_code == 429
            assert second.headers["Retry-After"] == "1"
            assert "max_concurrent" in second.json()["error"]["message"]
        # Once the first one is over, the tenant may run one again.
        deadline = time.monotonic() + 60
        while client.post("/v1/chat/completions", json=CHAT, headers=auth("single")).is_error:
            assert time.monotonic() < deadline, "the first request's slot was never freed"
            time.sleep(0.2)


def test_limits_hold_across_two_gateways(
    router: RouterServer, engines: dict[str, SimEngine]
) -> None:
    register(router, "fast", engines["fast"].url)
    answered = count_quota_reports_once_complete(router, 4)
    with (
        TestClient(build_app(make_gateway(router))) as one,
        TestClient(build_app(make_gateway(router))) as two,
    ):
        for _ in range(2):
            assert one.post("/v1/chat/completions", json=CHAT, headers=auth("free")).is_success
            assert two.post("/v1/chat/completions", json=CHAT, headers=auth("free")).is_success
        wait_for(
            "each gateway to hold the other's totals",
            lambda: len(answered) == 2 and min(answered.values()) >= 2,
        )
        # 4 of 4 used between the two: each gateway alone has seen only 2.
        assert one.post("/v1/chat/completions", json=CHAT, headers=auth("free")).status_code == 429
        assert two.post("/v1/chat/completions", json=CHAT, headers=auth("free")).status_code == 429


def test_a_replica_failing_before_the_first_byte_is_retried_on_another(
    router: RouterServer, engines: dict[str, SimEngine]
) -> None:
    # The dead replica looks idle, so it is picked first; the live one looks busy.
    register(router, "dead", "http://127.0.0.1:9")
    register(router, "fast", engines["fast"].url, waiting=5)
    with TestClient(build_app(make_gateway(router))) as client:
        response = client.post("/v1/chat/completions", json=CHAT, headers=auth("open"))
        assert response.status_code == 200
        assert metric(client, 'hpcserve_gateway_retries_total{model="tiny"}') == 1
    assert all(r.in_flight == 0 for r in router.registry)


def test_a_stream_whose_engine_dies_ends_with_an_error_event(router: RouterServer) -> None:
    doomed = SimEngine(MODEL, 50)
    register(router, "doomed", doomed.url)
    gateway = make_gateway(router)
    with TestClient(build_app(gateway)) as client:
        body = CHAT | {"stream": True, "max_tokens": 200}
        with client.stream("POST", "/v1/chat/completions", json=body, headers=auth("open")) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            doomed.stop()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1].startswith('data: {"error"')
        assert "mid-stream" in rest[-1]
    assert all(r.in_flight == 0 for r in router.registry)


def test_overflow_goes_external_unless_data_resident(
    router: RouterServer, engines: dict[str, SimEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXT_KEY", "sk-external")
    external = ExternalAPIConfig(
        base_url=engines["external"].url + "/v1", api_key_env="EXT_KEY", models={MODEL: "ext-model"}
    )
    # No replica of MODEL is registered: the router can place nothing.
    gateway = make_gateway(router, overflow=external)
    with TestClient(build_app(gateway)) as client:
        sdk = openai.OpenAI(
            base_url="http://testserver/v1", api_key=key("bursty"), http_client=client
        )
        reply = sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3)
        assert reply.model == "ext-model" and reply.usage and reply.usage.completion_tokens == 3
        stream = sdk.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=3, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert metric(client, 'hpcserve_gateway_overflow_total{model="tiny",tenant="bursty"}') == 2
        for tenant in ("resident", "open"):
            response = client.post("/v1/chat/completions", json=CHAT, headers=auth(tenant))
            assert response.status_code == 503 and response.headers["Retry-After"]
            assert response.json()["error"]["code"] == "no_replica"


def test_traces_carry_genai_attributes_under_the_clients_traceparent(
    router: RouterServer, engines: dict[str, SimEngine]
) -> None:
    register(router, "fast", engines["fast"].url)
    exporter = InMemorySpanExporter()
    tracing = Tracing(exporter=exporter)
    gateway = Gateway(
        GatewayConfig(api_keys=[ApiKey(tenant="open", sha256=hash_api_key(key("open")))]),
        routing_endpoint=router.config.routing_bind,
        configured_models={MODEL},
        tracing=tracing,
    )
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with TestClient(build_app(gateway)) as client:
        response = client.post(
            "/v1/chat/completions", json=CHAT, headers=auth("open") | {"traceparent": parent}
        )
        assert response.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request = spans[f"chat {MODEL}"]
    assert request.context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
    attrs = dict(request.attributes or {})
    assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.usage.output_tokens"] == 5 and attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["hpcserve.replica"] == "fast" and attrs["hpcserve.route_ms"] >= 0


def test_limits_hold_across_two_gateway_processes(
    router: RouterServer, engines: dict[str, SimEngine], tmp_path: Path
) -> None:
    register(router, "fast", engines["fast"].url)
    gateway = {
        "quota_sync_s": 0.05,
        "tenants": [{"name": "free", "requests_per_min": 4}],
        "api_keys": [{"tenant": "free", "sha256": hash_api_key(key("free"))}],
    }
    answered = count_quota_reports_once_complete(router, 4)
    with gateways(router.config, gateway, tmp_path, model=MODEL) as urls:

        def post(url: str) -> int:
            return httpx.post(
                url + "/v1/chat/completions", json=CHAT, headers=auth("free"), timeout=10
            ).status_code

        assert [post(urls[0]), post(urls[1]), post(urls[0]), post(urls[1])] == [200] * 4
        wait_for(
            "each gateway to hold the other's totals",
            lambda: len(answered) == 2 and min(answered.values()) >= 2,
        )
        assert [post(urls[0]), post(urls[1])] == [429, 429]


def _engine_hits(engine: SimEngine) -> float:
    for line in httpx.get(engine.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the engine reports no vllm:prefix_cache_hits_total")


LONG_PROMPT = "A prompt prefix another tenant must not be able to probe. " * 30


def test_each_tenant_has_its_own_prefix_cache(client: TestClient, engines) -> None:
    """The gateway sets each tenant's cache_salt last (a client's own cannot override it):
    a prompt one tenant sent is a cache hit for that tenant again, and for no other, even
    one that sends the first tenant's salt itself."""
    fast = engines["fast"]

    def hits_of(tenant: str, **extra: object) -> float:
        before = _engine_hits(fast)
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1, **extra}
        reply = client.post("/v1/completions", headers=auth(tenant), json=body)
        assert reply.status_code == 200, reply.text
        return _engine_hits(fast) - before

    from hpcserve.contracts.cache_salt import tenant_salt

    hits_of("open")
    assert hits_of("open") > 0  # the tenant's own prefix, cached
    assert hits_of("resident") == 0  # the same prompt from another tenant: computed
    assert hits_of("bursty", cache_salt=tenant_salt("open")) == 0  # a salt of its own choice
    assert hits_of("open", cache_salt="mine") == 0  # a client's own salt: its own cache
    assert hits_of("open", cache_salt="mine") > 0
    refused = client.post(
        "/v1/completions",
        headers=auth("open"),
        json={"model": MODEL, "prompt": "x", "cache_salt": "a/b"},
    )
    assert refused.status_code == 400 and "cache_salt" in refused.text


def test_tenants_share_prefixes_where_the_site_allows_it(router, engines) -> None:
    register(router, "fast", engines["fast"].url)
    shared = make_gateway(router, isolate_tenant_caches=False)
    with TestClient(build_app(shared)) as client:
        body = {"model": MODEL, "prompt": "Shared across tenants. " * 60, "max_tokens": 1}
        assert client.post("/v1/completions", headers=auth("open"), json=body).status_code == 200
        before = _engine_hits(engines["fast"])
        assert (
            client.post("/v1/completions", headers=auth("resident"), json=body).status_code == 200
        )
        assert _engine_hits(engines["fast"]) > before
