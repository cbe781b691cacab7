"""Issue 27 end to end: the Responses API (official `openai` SDK) and Anthropic's Messages API
(official `anthropic` SDK) through the real gateway process, on real vLLM CPU engines
registered with a real router by `hpcserve engine`.

The three-turn chain by previous_response_id is served by two replicas: the first turn by
replica A alone, the second by replica B after A was drained (SIGTERM: out of routing, then
gone), the third after the gateway restarted. The engine keeps no state; the gateway's
response store (SQLite under the state directory) carries the conversation, which the third
turn's prompt token count shows: it equals the chat template's count of all five messages.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from hpcserve.config import dump_config, hash_api_key, parse_config
from hpcserve.contracts.router_client import list_replicas
from hpcserve.router.server import RouterServer
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import loopback_router_config, running_router
from tests.services import gateway_argv, metrics_headers, service

pytestmark = pytest.mark.vllm

MODEL = "tiny"
PLAIN = "plain"  # a pool with messages_api = false (no engine needed to refuse it)
KEY, OTHER_KEY, LIMITED_KEY = "sk-resp-a", "sk-resp-b", "sk-resp-limited"


class Site:
    """A router, a gateway process (restartable) and the vLLM engines of one test module."""

    def __init__(self, router: RouterServer, work: Path, model: Path) -> None:
        self.router = router
        self.work = work
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engines: list[subprocess.Popen[bytes]] = []
        config = parse_config({
            "state_dir": str(work / "state"),
            "router": {"registry_bind": router.config.registry_bind,
                       "routing_bind": router.config.routing_bind,
                       "lease_s": router.config.lease_s,
                       "heartbeat_s": router.config.heartbeat_s,
                       "allow_plain_loopback": True},
            "gateway": {"port": self.port, "audit_log": "", "upstream_timeout_s": 120,
                        "api_keys": [{"tenant": "a", "sha256": hash_api_key(KEY)},
                                     {"tenant": "b", "sha256": hash_api_key(OTHER_KEY)},
                                     {"tenant": "limited", "sha256": hash_api_key(LIMITED_KEY)}],
                        "tenants": [{"name": "a"}, {"name": "b"},
                                    {"name": "limited", "allowed_models": [PLAIN]}]},
            "pools": [{"name": MODEL, "model_path": str(model), "engine": "vllm-cpu"},
                      {"name": PLAIN, "model_path": str(model), "engine": "vllm-cpu",
                       "messages_api": False}],
        })  # fmt: skip
        self.config_path = work / "gateway.toml"
        self.config_path.write_text(dump_config(config))

    def gateway(self) -> Any:
        return service(gateway_argv(self.config_path), self.url, timeout_s=90)

    def start_engine(self, name: str) -> subprocess.Popen[bytes]:
        log = (self.work / f"engine-{name}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "vllm-cpu",
             "--model-path", str(self.model), "--served-model-name", MODEL, "--pool", MODEL,
             "--router", self.router.config.registry_bind, "--bind-host", "127.0.0.1",
             "--advertise-host", "127.0.0.1", "--heartbeat-s", "0.25", "--drain-s", "5",
             "--", "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )  # fmt: skip
        log.close()
        self.engines.append(proc)
        return proc

    def replicas(self) -> list[str]:
        # The router answers in milliseconds, but this host's 2 cores are busy loading vLLM.
        routing = self.router.config.routing_bind
        return sorted(r.url for r in list_replicas(routing, timeout_s=15))

    def stop_all(self) -> None:
        for proc in self.engines:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.engines:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    work = tmp_path_factory.mktemp("responses")
    model = make_tiny_model("chat", work / "model")
    with running_router(loopback_router_config()) as router:
        site = Site(router, work, model)
        try:
            site.start_engine("a")
            wait_for("replica A to register", lambda: len(site.replicas()) == 1, timeout=300)
            yield site
        finally:
            site.stop_all()


@pytest.fixture
def gateway(site: Site) -> Iterator[str]:
    with site.gateway():
        yield site.url


_opened: list[openai.OpenAI | anthropic.Anthropic] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Every SDK client a test made is closed after it (no socket left to the collector)."""
    yield
    while _opened:
        _opened.pop().close()


def sdk(url: str, key: str = KEY) -> openai.OpenAI:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    _opened.append(client)
    return client


def claude(url: str, key: str = KEY) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)
    _opened.append(client)
    return client


def test_responses_create_stream_retrieve_delete_with_the_openai_sdk(
    gateway: str, site: Site
) -> None:
    client = sdk(gateway)
    first = client.responses.create(
        model=MODEL, input="Say hello", instructions="Be brief.", max_output_tokens=6
    )
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output_text and first.usage is not None and first.usage.output_tokens > 0
    assert first.store is not False

    events = list(
        client.responses.create(
            model=MODEL, input="Count to three", max_output_tokens=6, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    streamed = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == streamed.output_text and streamed.usage.output_tokens > 0

    again = client.responses.retrieve(streamed.id)
    assert again.output_text == streamed.output_text
    (item,) = client.responses.input_items.list(streamed.id).data
    assert item.type == "message" and item.content[0].text == "Count to three"  # type: ignore[union-attr]

    with pytest.raises(openai.NotFoundError):
        sdk(gateway, OTHER_KEY).responses.retrieve(first.id)  # another tenant's: 404
    with pytest.raises(openai.NotFoundError):
        sdk(gateway, OTHER_KEY).responses.create(
            model=MODEL, input="x", previous_response_id=first.id
        )
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=[{"type": "reasoning", "summary": []}])  # type: ignore[list-item]
    assert bad.value.body["param"] == "input[0].type"  # type: ignore[index]
    with pytest.raises(openai.PermissionDeniedError):
        sdk(gateway, LIMITED_KEY).responses.create(model=MODEL, input="x")

    metrics = httpx.get(gateway + "/metrics", headers=metrics_headers(site.config_path)).text
    counted = [line for line in metrics.splitlines() if 'endpoint="responses"' in line]
    assert (
        'hpcserve_gateway_requests_total{endpoint="responses",model="tiny",status="200",'
        'tenant="a"} 3.0' in counted
    ), counted
    assert "hpcserve_gateway_responses_stored_total 2.0" in metrics  # not store=False's


def test_messages_with_the_anthropic_sdk(gateway: str) -> None:
    client = claude(gateway)
    conversation: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Hi there"}]
    reply = client.messages.create(
        model=MODEL, max_tokens=6, system="Be brief.", messages=conversation
    )
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=conversation)
    assert counted.input_tokens == reply.usage.input_tokens > 0

    with client.messages.stream(model=MODEL, max_tokens=6, messages=conversation) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens > 0  # type: ignore[union-attr]

    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=PLAIN, max_tokens=3, messages=conversation)
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "The model 'plain' does not serve the Messages API (its pool sets "
            "messages_api = false)",
        },
    }
    with pytest.raises(anthropic.AuthenticationError):
        claude(gateway, "sk-nobody").messages.create(
            model=MODEL, max_tokens=3, messages=conversation
        )
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        claude(gateway, LIMITED_KEY).messages.create(
            model=MODEL, max_tokens=3, messages=conversation
        )
    assert denied.value.body["error"]["type"] == "permission_error"  # type: ignore[index]


def test_tokenize_and_detokenize_per_model(gateway: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(
        gateway + "/tokenize",
        json={"model": MODEL, "prompt": "hello world", "add_special_tokens": False},
        headers=auth,
    ).json()["tokens"]
    text = httpx.post(
        gateway + "/detokenize", json={"model": MODEL, "tokens": tokens}, headers=auth
    ).json()["prompt"]
    assert text == "hello world"
    refused = httpx.post(
        gateway + "/tokenize",
        json={"model": MODEL, "prompt": "x"},
        headers={"Authorization": f"Bearer {LIMITED_KEY}"},
    )
    assert refused.status_code == 403
    assert (
        httpx.post(gateway + "/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401
    )
    unknown = httpx.post(gateway + "/tokenize", json={"model": "nope", "prompt": "x"}, headers=auth)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_three_turn_chain_across_replicas_a_drain_and_a_gateway_restart(site: Site) -> None:
    (replica_a,) = site.replicas()
    with ExitStack() as running:
        running.enter_context(site.gateway())
        client = sdk(site.url)
        turn1 = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=5)
        engine_b = site.start_engine("b")
        wait_for("replica B to register", lambda: len(site.replicas()) == 2, timeout=300)
        site.engines[0].send_signal(signal.SIGTERM)  # drain A: out of routing, then gone
        wait_for("replica A to leave", lambda: replica_a not in site.replicas(), timeout=120)
        assert site.engines[0].wait(120) == 0
        assert engine_b.poll() is None
        turn2 = client.responses.create(
            model=MODEL, input="What is my name?", previous_response_id=turn1.id,
            max_output_tokens=5,
        )  # fmt: skip
    with site.gateway():  # a new gateway process: the store is on disk
        client = sdk(site.url)
        turn3 = client.responses.create(
            model=MODEL, input="Thanks.", previous_response_id=turn2.id, max_output_tokens=5
        )
        assert client.responses.retrieve(turn1.id).output_text == turn1.output_text
        conversation = [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": turn1.output_text},
            {"role": "user", "content": "What is my name?"},
            {"role": "assistant", "content": turn2.output_text},
            {"role": "user", "content": "Thanks."},
        ]
        count = httpx.post(
            site.url + "/tokenize",
            json={"model": MODEL, "messages": conversation},
            headers={"Authorization": f"Bearer {KEY}"},
        ).json()["count"]
    assert turn3.previous_response_id == turn2.id
    assert turn3.usage is not None and turn3.usage.input_tokens == count
    assert turn2.usage is not None and turn2.usage.input_tokens < count
