"""The gateway's two-step exchange for a disaggregated model (gateway/disagg.py) through the
real gateway app and the real router over ZeroMQ, with the official openai client; the
engines are small HTTP servers on loopback that record what they are sent (the real vLLM
engines are in tests/integration/test_pd_slurm.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.router.server import RouterServer
from tests.engine_stub import EVENT_STREAM, JSON, USAGE, StubEngine, chat_answer, chat_stream
from tests.routers import loopback_router_config, running_router
from tests.waiting import until

KEY = "sk-pd"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]]}


class Engine(StubEngine):
    """Answers chat completions (streamed when asked), or `status` with an error; keeps each
    request body decoded in `bodies`."""

    def __init__(
        self, status: int = 200, params: dict[str, Any] | None = None, *, stall: bool = False
    ) -> None:
        self.status = status
        self.params = params
        self.bodies: list[dict[str, Any]] = []
        # stall: no answer until released (close() releases it)
        self.released = threading.Event()
        if not stall:
            self.released.set()
        super().__init__()

    def answer(self, raw: bytes) -> tuple[int, str, bytes]:
        body = json.loads(raw)
        self.bodies.append(body)
        self.released.wait(120)
        if self.status != 200:
            return self.status, JSON, b'{"error": {"message": "boom"}}'
        if body.get("stream"):
            events: list[dict[str, Any]] = [
                {"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("a", "b")
            ]
            events.append({"choices": [], "usage": USAGE})
            return 200, EVENT_STREAM, chat_stream(events)
        extra = {} if self.params is None else {"kv_transfer_params": self.params}
        return 200, JSON, chat_answer("ab", "length", **extra)

    def close(self) -> None:
        self.released.set()
        super().close()


@contextmanager
def pd_model(
    prefill: Engine, decode_urls: list[str], **gateway: Any
) -> Iterator[tuple[openai.OpenAI, CollectorRegistry, RouterServer]]:
    """A router with the prefill replica and the decode replicas of model "m" registered by
    real agents, and the gateway in front (`gateway`: more GatewayConfig settings)."""
    with running_router(loopback_router_config(lease_s=600.0)) as router:
        replicas = [p.Register("pf", "m", prefill.url, node="n1", role="prefill")]
        replicas += [
            p.Register(f"d{i}", "m", url, node="n1", role="decode")
            for i, url in enumerate(decode_urls)
        ]
        agents = [RegistryAgent(router.config.registry_bind, r) for r in replicas]
        metrics = CollectorRegistry()
        gateway = Gateway(
            GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))], **gateway),
            routing_endpoint=router.config.routing_bind,
            configured_models={"m"},
            metrics_registry=metrics,
        )
        try:
            for agent in agents:
                agent.register()
                agent.process_replies(30.0)
                assert agent.registered
            with TestClient(build_app(gateway)) as http:
                client = openai.OpenAI(
                    base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
                )
                yield client, metrics, router
        finally:
            for agent in agents:
                agent.close()


def outcome(metrics: CollectorRegistry, name: str, reason: str | None = None) -> float:
    """Requests of model "m" with this outcome (and reason, when given)."""
    return sum(
        sample.value
        for family in metrics.collect()
        for sample in family.samples
        if sample.name == "hpcserve_gateway_pd_requests_total"
        and sample.labels["model"] == "m"
        and sample.labels["outcome"] == name
        and reason in (None, sample.labels["reason"])
    )


MESSAGES = [{"role": "user", "content": "a long document"}]


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def test_prefill_then_decode_with_the_transfer_parameters_streamed_or_not(engines):
    prefill, decode = Engine(params=PARAMS), Engine()
    engines += [prefill, decode]
    with pd_model(prefill, [decode.url]) as (client, metrics, router):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50)
        assert reply.choices[0].message.content == "ab"
        stream = client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=50, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "ab"
        assert outcome(metrics, "transferred") == 2
        replicas = {r.replica_id: r for r in router.registry}
        # Both replicas are released after each request (the router reads the Releases
        # on its own thread).
        asyncio.run(until("both replicas released", lambda: _idle(replicas, "pf", "d0")))
    for sent in prefill.bodies:
        assert sent["max_tokens"] == 1 and "stream" not in sent
        assert sent["kv_transfer_params"]["do_remote_decode"] is True
        assert sent["messages"] == MESSAGES
    whole, streamed = decode.bodies
    assert whole["kv_transfer_params"] == PARAMS and whole["max_tokens"] == 50
    assert streamed["kv_transfer_params"] == PARAMS and streamed["stream"] is True
    assert "kv_transfer_params" not in whole.get("stream_options", {})


def _idle(replicas: dict[str, Any], *ids: str) -> bool:
    return all(replicas[i].in_flight == 0 for i in ids)


def test_a_failed_prefill_leaves_the_prompt_to_the_decode_replica(engines):
    prefill, decode = Engine(status=500), Engine()
    engines += [prefill, decode]
    with pd_model(prefill, [decode.url]) as (client, metrics, _router):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50)
        assert reply.choices[0].message.content == "ab"
        assert outcome(metrics, "prefill_failed", "error") == 1
    [sent] = decode.bodies
    assert "kv_transfer_params" not in sent  # it computes the prompt itself


def test_a_stalled_prefill_is_abandoned_at_its_own_timeout(engines):
    """gateway.pd_prefill_timeout_s, not upstream_timeout_s (600 s here), bounds the prefill
    step: a prefill replica that never answers leaves the prompt to the decode replica."""
    prefill, decode = Engine(params=PARAMS, stall=True), Engine()
    engines += [prefill, decode]
    with pd_model(prefill, [decode.url], pd_prefill_timeout_s=0.5) as (client, metrics, router):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50)
        assert reply.choices[0].message.content == "ab"
        assert outcome(metrics, "prefill_failed", "timeout") == 1
        assert outcome(metrics, "transferred") == 0
        replicas = {r.replica_id: r for r in router.registry}
        asyncio.run(until("the abandoned prefill released", lambda: _idle(replicas, "pf")))
    assert len(prefill.bodies) == 1  # it got the prefill step, and never answered it
    [sent] = decode.bodies
    assert "kv_transfer_params" not in sent  # it computes the prompt itself


def test_an_unreachable_prefill_replica_is_no_failure_either(engines):
    decode = Engine()
    gone = Engine()
    gone.close()  # its port now refuses connections
    engines.append(decode)
    with pd_model(gone, [decode.url]) as (client, metrics, _router):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50)
        assert reply.choices[0].message.content == "ab"
        assert outcome(metrics, "prefill_failed", "unreachable") == 1


def test_a_decode_replica_failing_before_its_answer_is_retried_elsewhere(engines):
    prefill, broken, decode = Engine(params=PARAMS), Engine(status=503), Engine()
    engines += [prefill, broken, decode]
    with pd_model(prefill, [broken.url, decode.url]) as (client, _metrics, _router):
        for _ in range(4):  # whichever decode replica the router picks first
            reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50)
            assert reply.choices[0].message.content == "ab"
    assert len(decode.bodies) == 4
    assert all(b["kv_transfer_params"] == PARAMS for b in decode.bodies + broken.bodies)


def test_a_model_whose_every_replica_fails_gets_a_clean_error(engines):
    prefill, broken = Engine(status=500), Engine(status=503)
    engines += [prefill, broken]
    with (
        pd_model(prefill, [broken.url]) as (client, _metrics, _router),
        pytest.raises(openai.APIStatusError) as failed,
    ):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=50)
    assert failed.value.status_code in (502, 503)
