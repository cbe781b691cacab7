"""The walking skeleton, end to end: `hpcserve up` on a real two-node Slurm cluster starts
router, gateway and pool manager; the pool manager's Slurm job runs a real vLLM CPU engine
that registers over ZeroMQ; the official `openai` client talks to the gateway; `hpcserve
down` leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from hpcserve.config import PlatformConfig, PoolConfig, dump_config, with_default_curve_dir
from hpcserve.contracts.engine_token import auth_headers, read_token
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.batch.priority import ENGINE_PRIORITY, PRIORITY_HEADER
from hpcserve.stack import Stack
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import conf_processes, free_port_block
from tests.processes import (
    busiest_processes,
    job_cgroup_processes,
    processes_mentioning,
    session_processes,
)
from tests.services import metrics_headers, stack_config

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

API_KEY = "sk-e2e-test-key"
MODEL = "tiny-chat"
EMBED = "tiny-embed"
RERANK = "tiny-rerank"
# LoRA adapters of the chat model (issue 6): docs-a loaded at start, the others on demand.
ADAPTERS = {"docs-a": 1, "docs-b": 2, "docs-c": 3}  # name -> seed
# At most 4 sequences running: a queue forms, in which priority counts (issue 10).
CHAT_ENGINE_ARGS = [
    "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, PlatformConfig]]:
    state = tmp_path_factory.mktemp("e2e") / "state"
    state.mkdir()
    _register_chat_model_and_adapters(state)
    config = stack_config(
        state,
        api_keys={"e2e": API_KEY},
        pools=[
            PoolConfig(
                name=MODEL,
                model_ref=f"{MODEL}@1",  # registered by `up`, staged by the job
                replicas=1,
                engine="vllm-cpu",
                engine_args=CHAT_ENGINE_ARGS,
                env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                max_loras=2,
                max_lora_rank=8,
                lora_adapters=["docs-a"],
                tool_call_parser="hermes",  # as the demo pool (issue 17)
            ),
            *(
                PoolConfig(
                    name=name,
                    model_path=str(make_tiny_model(kind, state / "models" / name)),
                    engine="vllm-cpu",
                    engine_args=["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"],
                    env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                )
                for name, kind in ((EMBED, "embed"), (RERANK, "rerank"))
            ),
        ],
    )
    # One replica: hints are skipped by default (nothing to choose); the KV-routing test
    # below checks their hashes against vLLM's own, so they are sent anyway.
    gateway = msgspec.structs.replace(config.gateway, prefix_hints_min_replicas=1)
    # The priority test counts the chat engine's queue exactly; a generation probe (one every
    # 10 s by default, at the interactive priority) would be counted in it. The probes have
    # their own tests (tests/integration/test_health*.py).
    health = msgspec.structs.replace(config.health, probe_interval_s=3600.0)
    config = msgspec.structs.replace(config, gateway=gateway, health=health)
    config = with_default_curve_dir(config)  # CURVE in <state>/curve, as loading it gives
    (state / "hpcserve.toml").write_text(dump_config(config))
    (state / "demo-api-key").write_text(API_KEY + "\n")
    up = Stack(state, slurm_port=free_port_block())  # below the ephemeral range
    try:
        assert up.up(launcher="slurm", timeout_s=600) == 0, "hpcserve up failed (see output)"
        yield up, config
    finally:
        up.down()


def _register_chat_model_and_adapters(state: Path) -> None:
    from hpcserve.modelcache.manifest import build_manifest
    from hpcserve.modelcache.registry import Registry

    chat = make_tiny_model("chat", state / "models" / MODEL)
    with Registry(state / "registry.sqlite3") as registry:
        registry.add_version(MODEL, str(chat), build_manifest(chat))
        for name, seed in ADAPTERS.items():
            adapter = make_tiny_model("lora", state / "adapters" / name, seed=seed)
            registry.add_adapter(name, MODEL, str(adapter), build_manifest(adapter), rank=8)


@pytest.fixture(scope="module")
def client(stack: tuple[Stack, PlatformConfig]) -> openai.OpenAI:
    _, config = stack
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.gateway.port}/v1",
        api_key=API_KEY,
        max_retries=0,
        timeout=60,
    )


def test_models_lists_every_pool_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert sorted(m.id for m in models if m.id not in ADAPTERS) == [MODEL, EMBED, RERANK]


def test_chat_completion_served_by_vllm_in_a_slurm_job(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=12,
        temperature=0,
    )
    assert reply.model == MODEL
    assert reply.object == "chat.completion"
    (choice,) = reply.choices
    assert choice.finish_reason in ("length", "stop")
    assert choice.message.role == "assistant"
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert 0 < reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_greedy_answers_are_reproducible(client: openai.OpenAI) -> None:
    def ask() -> str | None:
        return (
            client.completions.create(
                model=MODEL, prompt="The cluster", max_tokens=8, temperature=0
            )
            .choices[0]
            .text
        )

    assert ask() == ask()


def test_streamed_chat_completion(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2, "the answer should arrive in several chunks"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert {c.model for c in chunks} == {MODEL}


def test_raw_stream_ends_with_done(stack: tuple[Stack, PlatformConfig]) -> None:
    _, config = stack
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"http://127.0.0.1:{config.gateway.port}/v1/completions",
            "-H",
            f"Authorization: Bearer {API_KEY}",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    events = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["model"] == MODEL for e in events[:-1])


def test_errors_are_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # vLLM's own validation errors come back as they are, status and body.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=100_000
        )


def test_embeddings_from_a_bert_pool(client: openai.OpenAI) -> None:
    texts = ["bill of lading", "customs declaration", "bill of lading"]
    reply = client.embeddings.create(model=EMBED, input=texts)
    assert reply.model == EMBED and len(reply.data) == 3
    vectors = [d.embedding for d in sorted(reply.data, key=lambda d: d.index)]
    assert {len(v) for v in vectors} == {128}
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert reply.usage.prompt_tokens > 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_from_a_cross_encoder_pool(stack: tuple[Stack, PlatformConfig], path: str) -> None:
    _, config = stack
    docs = ["a bill of lading", "a weather report", "the consignee and the port"]
    response = httpx.post(
        f"http://127.0.0.1:{config.gateway.port}{path}",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": RERANK, "query": "shipping documents", "documents": docs},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True), "results come best first"


def test_score_pairs_and_a_chat_model_refuses_embeddings(
    stack: tuple[Stack, PlatformConfig], client: openai.OpenAI
) -> None:
    _, config = stack
    response = httpx.post(
        f"http://127.0.0.1:{config.gateway.port}/v1/score",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": RERANK, "text_1": "shipping", "text_2": ["bill of lading", "weather"]},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2
    # The chat engine has no embedding endpoint: the client gets vLLM's error, not a 500.
    with pytest.raises(openai.APIStatusError) as err:
        client.embeddings.create(model=MODEL, input=["x"])
    assert 400 <= err.value.status_code < 500


# -- Multi-LoRA (issue 6): one chat replica, max_loras 2, docs-a static, the rest on demand


def _greedy(client: openai.OpenAI, model: str) -> tuple[str, str]:
    reply = client.completions.create(
        model=model, prompt="The cluster", max_tokens=8, temperature=0
    )
    return reply.model, reply.choices[0].text


def _adapter_listing(config: PlatformConfig) -> dict[str, tuple[int, str]]:
    response = httpx.get(
        f"http://127.0.0.1:{config.gateway.port}/v1/models",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return {
        m["id"]: (m["replicas"], m.get("parent", ""))
        for m in response.json()["data"]
        if m["id"] in ADAPTERS
    }


def test_lora_static_adapter_is_served_and_answers_unlike_the_base(
    stack: tuple[Stack, PlatformConfig], client: openai.OpenAI
) -> None:
    _, config = stack
    # Every registered adapter of the chat model is listed; only docs-a is loaded now.
    assert _adapter_listing(config) == {
        "docs-a": (1, MODEL),
        "docs-b": (0, MODEL),
        "docs-c": (0, MODEL),
    }
    base_model, base = _greedy(client, MODEL)
    adapter_model, adapted = _greedy(client, "docs-a")
    assert (base_model, adapter_model) == (MODEL, "docs-a")
    assert adapted != base


def test_lora_adapter_loaded_on_demand_then_least_recently_used_unloaded(
    stack: tuple[Stack, PlatformConfig], client: openai.OpenAI
) -> None:
    _, config = stack
    _, a = _greedy(client, "docs-a")
    model, b = _greedy(client, "docs-b")  # not loaded: the router has the engine load it
    assert model == "docs-b" and b != a
    assert _adapter_listing(config)["docs-b"] == (1, MODEL)
    # Two loaded (max_loras 2), docs-a the least recently used: docs-c takes its place.
    _greedy(client, "docs-b")
    assert _greedy(client, "docs-c")[0] == "docs-c"
    assert _adapter_listing(config) == {
        "docs-a": (0, MODEL),
        "docs-b": (1, MODEL),
        "docs-c": (1, MODEL),
    }
    # docs-a comes back on demand, the same weights: the same greedy answer.
    assert _greedy(client, "docs-a") == ("docs-a", a)
    (log,) = Path(config.slurm.log_dir).glob(f"hpcserve-{MODEL}-*.out")
    text = log.read_text()
    cache = config.engine.cache_dir
    assert f"adapter docs-a staged at {cache}/docs-a@1-" in text  # static, before vLLM
    assert f"adapter docs-b staged at {cache}/docs-b@1-" in text  # on demand
    assert "LoRA adapter docs-a unloaded" in text


# -- Batch API (issue 10): a small batch of chat and one of embeddings, run by real vLLM ------


def _run_batch(
    client: openai.OpenAI,
    endpoint: str,
    bodies: list[dict[str, object]],
    metadata: dict[str, str] | None = None,
) -> list:
    data = b"".join(
        json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": endpoint, "body": body})
        .encode() + b"\n"
        for i, body in enumerate(bodies)
    )  # fmt: skip
    upload = client.files.create(file=("batch.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata=metadata,
    )
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in (
        "completed", "failed", "expired", "cancelled"
    ):  # fmt: skip
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.5)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(bodies), 0)
    assert batch.output_file_id is not None and batch.error_file_id is None
    content = client.files.content(batch.output_file_id).content
    output = [json.loads(line) for line in content.splitlines()]
    assert sorted(o["custom_id"] for o in output) == [f"doc-{i}" for i in range(len(bodies))]
    return sorted(output, key=lambda o: o["custom_id"])


def test_batch_of_chat_requests_runs_on_vllm(client: openai.OpenAI) -> None:
    bodies = [
        {"model": MODEL, "max_tokens": 8, "temperature": 0,
         "messages": [{"role": "user", "content": f"Extract the consignee of document {i}"}]}
        for i in range(6)
    ]  # fmt: skip
    output = _run_batch(client, "/v1/chat/completions", bodies)
    for line in output:
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] > 0


def test_batch_of_embeddings_runs_on_vllm(client: openai.OpenAI) -> None:
    output = _run_batch(
        client, "/v1/embeddings", [{"model": EMBED, "input": f"line {i}"} for i in range(4)]
    )
    for line in output:
        data = line["response"]["body"]["data"]
        assert len(data) == 1 and len(data[0]["embedding"]) > 0


# -- Gateway (issue 5): structured output and sampling options pass through to vLLM ---------

YES_NO = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_json_schema_output_is_guided_by_vllm(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is this a bill of lading?"}],
        max_tokens=48,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "yes_no", "schema": YES_NO, "strict": True},
        },
    )
    content = reply.choices[0].message.content or ""
    if reply.choices[0].finish_reason == "stop":
        assert json.loads(content)["answer"] in ("yes", "no")
    else:  # a random tiny model may pad with whitespace; what it wrote still follows the schema
        assert "".join(content.split()).startswith('{"answer"')


def test_an_invalid_json_schema_is_a_400_naming_the_problem(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "objekt"}},
            },
        )
    assert "response_format.json_schema.schema" in str(err.value)


def test_n_stop_logprobs_seed_and_max_completion_tokens_pass_through(
    client: openai.OpenAI,
) -> None:
    messages = [{"role": "user", "content": "Count to ten"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        n=2,
        max_completion_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=1.0,
        seed=7,
    )
    assert len(reply.choices) == 2
    assert reply.usage is not None and reply.usage.completion_tokens <= 6
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    assert len(logprobs.content[0].top_logprobs) == 2

    def sampled(seed: int) -> str | None:
        return (
            client.completions.create(
                model=MODEL, prompt="The port", max_tokens=6, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sampled(11) == sampled(11)
    first = client.completions.create(model=MODEL, prompt="The port", max_tokens=6, temperature=0)
    text = first.choices[0].text
    stop = text.strip()[:2] if text.strip() else None
    if stop:
        stopped = client.completions.create(
            model=MODEL, prompt="The port", max_tokens=6, temperature=0, stop=[stop]
        )
        assert stop not in stopped.choices[0].text
        assert stopped.choices[0].finish_reason == "stop"


def test_gateway_metrics_count_streamed_tokens_and_time_to_first_token(
    stack: tuple[Stack, PlatformConfig], client: openai.OpenAI
) -> None:
    _, config = stack
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, stream=True
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks), "usage the client did not ask for is hidden"
    url = f"http://127.0.0.1:{config.gateway.port}/metrics"
    assert httpx.get(url, timeout=10).status_code == 401, "/metrics names tenants"
    token = read_token(config.metrics_token_path())
    metrics = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10).text
    assert f'hpcserve_gateway_time_to_first_token_seconds_count{{model="{MODEL}"}}' in metrics
    assert f'direction="out",model="{MODEL}",tenant="e2e"' in metrics


# -- The OpenAI SDK's surface (issue 17): models.retrieve, tools and tool_choice, json_object,
# rerank and score through the SDK's own client, files and batches listed and deleted ----------

# A strict tool: vLLM guides its arguments by the schema (a non-strict one gets the call's
# envelope guided and arguments that are any JSON: vLLM 0.32's --tool-strict-level auto).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Random weights greedily pad guided JSON with whitespace until max_tokens; sampled with a
# seed they close it (seed 0: ~75 tokens) and the answer repeats.
SAMPLED = {"temperature": 1.0, "seed": 0, "max_tokens": 300}


def test_models_retrieve_answers_served_names_adapters_and_unknown_names(
    client: openai.OpenAI,
) -> None:
    chat = client.models.retrieve(MODEL)
    assert (chat.id, chat.object, chat.owned_by) == (MODEL, "model", "hpcserve")
    assert chat.replicas == 1  # type: ignore[attr-defined]
    assert client.models.retrieve(EMBED).id == EMBED
    adapter = client.models.retrieve("docs-b")  # registered, loaded or not
    assert adapter.parent == MODEL  # type: ignore[attr-defined]  # vLLM's field
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert client.models.retrieve(RERANK).model_dump() == listed[RERANK]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"


def test_a_named_tool_choice_calls_that_function_with_valid_arguments(
    client: openai.OpenAI,
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **SAMPLED,  # type: ignore[arg-type]
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "stop", choice  # OpenAI's for a forced function too
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")  # type: ignore[union-attr]


def test_a_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        **SAMPLED,  # type: ignore[arg-type]
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]  # JSON, always
    assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
    if call.function.name == "get_weather":  # type: ignore[union-attr]
        assert arguments["city"] in ("Paris", "Oslo")


def test_auto_and_none_tool_choices_answer_in_the_chat_shape(client: openai.OpenAI) -> None:
    for tool_choice in ("auto", "none"):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=tool_choice,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
        )
        (choice,) = reply.choices
        message = choice.message
        # A random model writes text, not a call; a call would come parsed, not as text.
        if message.tool_calls:
            assert tool_choice == "auto" and choice.finish_reason == "tool_calls"
        else:
            assert isinstance(message.content, str) and "<tool_call>" not in message.content
            assert choice.finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.completion_tokens > 0


def test_a_streamed_tool_call_arrives_in_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
        **SAMPLED,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].id and deltas[0].function is not None
    assert deltas[0].function.name == "get_weather"
    assert {d.index for d in deltas} == {0}
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert all(c.usage is None for c in chunks), "usage the client did not ask for is hidden"


def test_a_conversation_carries_tool_calls_and_their_results(client: openai.OpenAI) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]

    def prompt_tokens(history: list[dict[str, object]]) -> int:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=history,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            max_tokens=4,
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    # The template writes the call and its result into the prompt (hpcserve/tinymodels.py).
    assert prompt_tokens(messages) > prompt_tokens(ASK_WEATHER) + 20


def test_json_object_output_is_guided_by_vllm(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe the port as JSON"}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=1.0,
        seed=3,
    )
    content = reply.choices[0].message.content or ""
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut at max_tokens: what it wrote still opens an object
        assert content.lstrip().startswith("{")


def test_rerank_and_score_through_the_sdks_own_client(client: openai.OpenAI) -> None:
    # The SDK has no rerank: apps post to it with the client they have (same key, base URL).
    docs = ["a bill of lading", "a weather report"]
    reranked = client.post(
        "/rerank",
        body={"model": RERANK, "query": "shipping documents", "documents": docs},
        cast_to=httpx.Response,
    ).json()
    assert sorted(r["index"] for r in reranked["results"]) == [0, 1]
    scored = client.post(
        "/score",
        body={"model": RERANK, "text_1": "shipping", "text_2": docs},
        cast_to=httpx.Response,
    ).json()
    assert len(scored["data"]) == 2
    with pytest.raises(openai.NotFoundError):
        client.post(
            "/rerank", body={"model": "nope", "query": "q", "documents": ["d"]}, cast_to=object
        )


def test_files_and_batches_are_listed_retrieved_and_deleted(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = [
        {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": named,
         **SAMPLED, "seed": seed}
        for seed in range(2)
    ]  # fmt: skip
    tag = {"test": "files-and-batches"}
    output = _run_batch(client, "/v1/chat/completions", bodies, metadata=tag)
    for line in output:
        (call,) = line["response"]["body"]["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
    (batch,) = [b for b in client.batches.list() if b.metadata == tag]
    assert batch.output_file_id is not None
    assert client.batches.retrieve(batch.id).status == "completed"
    files = {f.id: f for f in client.files.list()}
    assert {batch.input_file_id, batch.output_file_id} <= files.keys()
    upload = client.files.retrieve(batch.input_file_id)
    assert (upload.purpose, upload.bytes) == ("batch", files[batch.input_file_id].bytes)
    assert client.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.input_file_id)


# -- KV-cache-aware routing (issue 4): vLLM's KV events reach the router's prefix index ------


def _router_counter(config: PlatformConfig, name: str) -> float:
    text = httpx.get(
        f"http://127.0.0.1:{config.router.metrics_port}/metrics",
        headers=metrics_headers(Path(config.state_dir) / "hpcserve.toml"),  # the metrics token
        timeout=10,
    ).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_kv_events_from_vllm_fill_the_index_and_a_repeated_prompt_hits_it(
    stack: tuple[Stack, PlatformConfig], client: openai.OpenAI
) -> None:
    from hpcserve.contracts.prompt_tokens import PromptTokenizer

    _, config = stack
    messages = [
        {"role": "system", "content": "You answer questions about the router. " * 14},
        {"role": "user", "content": "Which replica holds this prefix?"},
    ]
    tokens = PromptTokenizer.from_dir(Path(config.state_dir) / "models" / MODEL).chat_tokens(
        messages
    )
    full_blocks = len(tokens) // 128  # vLLM CPU's block size
    assert full_blocks >= 2
    stored = _router_counter(config, "hpcserve_router_kv_blocks_stored_total")
    cached = _router_counter(config, "hpcserve_router_cached_prompt_tokens_total")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    # The gateway tokenized exactly what vLLM prefilled.
    assert first.usage is not None and first.usage.prompt_tokens == len(tokens)
    deadline = time.monotonic() + 30
    while _router_counter(config, "hpcserve_router_kv_blocks_stored_total") < stored + full_blocks:
        assert time.monotonic() < deadline, "no BlockStored events reached the router"
        time.sleep(0.2)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    # Our hashes of the prompt matched our hashes of vLLM's token_ids, block for block.
    hit = _router_counter(config, "hpcserve_router_cached_prompt_tokens_total") - cached
    assert hit == full_blocks * 128


# -- Batch API (issue 10): engines schedule by priority, batch after interactive -------------


async def _completion_order(url: str, token: str) -> tuple[list[str], bool, str]:
    """Fills the engine's 4 running slots with long batch requests, queues 8 short batch
    requests behind them, then one short interactive request; all straight to the engine.
    Returns the order in which their answers came, whether the engine's queue was seen
    holding the interactive request behind all 8 queued batch requests (what makes the order
    a test of the policy), and a trace of what the engine's gauges showed, when each answer
    came and which processes were busy, for a failure's message.

    Each step waits for the engine's own gauges to show it, exactly (a request left over
    from an earlier test would make a count hold without the one it waits for): on a loaded
    host the API server may pass the requests on seconds late, one by one. The first wave is
    long (4,000 tokens) so that the rest reach the queue while it runs. Whole answers, not
    streams: a wave's answers come together, a second before the next wave's, where a
    stream's first token comes whenever a busy host lets the API server and this client
    read it."""
    order: list[str] = []
    trace: list[str] = []
    started = time.monotonic()

    def note(event: str) -> None:
        trace.append(f"{time.monotonic() - started:6.2f}s {event}")

    async def chat(http: httpx.AsyncClient, name: str, priority: str, max_tokens: int) -> None:
        body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Extract document {name}"}]}  # fmt: skip
        response = await http.post(
            url + "/v1/chat/completions", json=body, headers={PRIORITY_HEADER: priority}
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == max_tokens
        order.append(name)
        note(f"answer {name}")

    def send(http: httpx.AsyncClient, name: str, priority: str, tokens: int) -> asyncio.Task[None]:
        note(f"send {name}")
        return asyncio.create_task(chat(http, name, ENGINE_PRIORITY[priority], tokens))

    async def queue_is(
        http: httpx.AsyncClient, running: int, waiting: int, tasks: list[asyncio.Task[None]]
    ) -> bool:
        last = None
        while not all(task.done() for task in tasks):
            metrics = (await http.get(url + "/metrics")).text
            now = (_engine_gauge(metrics, "running"), _engine_gauge(metrics, "waiting"))
            if now != last:
                note(f"engine: {now[0]:.0f} running, {now[1]:.0f} waiting")
                last = now
            if now == (running, waiting):
                return True
            await asyncio.sleep(0.02)
        return False

    # Straight to the engine, which answers only the stack's callers: the engine token.
    async with httpx.AsyncClient(timeout=300, headers=auth_headers(token)) as http:
        idle = asyncio.create_task(asyncio.sleep(120))
        seen = await queue_is(http, 0, 0, [idle])  # nothing left over from earlier tests
        idle.cancel()
        tasks = [send(http, f"batch-{i}", "batch", 4000) for i in range(4)]
        load = asyncio.create_task(asyncio.to_thread(busiest_processes, 2.0))
        seen = seen and await queue_is(http, 4, 0, tasks)
        tasks += [send(http, f"batch-{i}", "batch", 500) for i in range(4, 12)]
        seen = seen and await queue_is(http, 4, 8, tasks)
        tasks.append(send(http, "interactive", "interactive", 500))
        seen = seen and await queue_is(http, 4, 9, tasks)
        await asyncio.gather(*tasks)
    trace.append(f"the busiest processes over 2 s from the first wave:\n{await load}")
    return order, seen, "\n".join(trace)


def _engine_gauge(metrics: str, what: str) -> float:
    """vLLM's gauge `vllm:num_requests_<what>`, summed over its engines; not over other
    series whose names start the same way (`vllm:num_requests_waiting_by_reason`)."""
    name = f"vllm:num_requests_{what}"
    lines = metrics.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_an_interactive_request_overtakes_queued_batch_requests_on_vllm(
    stack: tuple[Stack, PlatformConfig],
) -> None:
    _, config = stack
    replicas = list_replicas(config.router.routing_bind, curve_dir=config.router.curve_dir)
    url = next(r.url for r in replicas if r.model == MODEL)
    # The pool's default scheduling policy is priority; 4 run at once, 8 batch requests wait.
    token = read_token(config.engine_token_path())
    # Where this host's load kept the queue from being seen as planned (the first wave ended
    # first, or the API server fell behind), the run says nothing: it is run again.
    for _ in range(5):
        order, queued_behind, trace = asyncio.run(_completion_order(url, token))
        if queued_behind:
            break
    # pytest.fail, not assert: pytest would cut the trace to its first lines.
    if not queued_behind:
        pytest.fail(f"5 runs, none saw the interactive request queued:\n{trace}")
    assert sorted(order) == sorted(["interactive", *(f"batch-{i}" for i in range(12))])
    # First come, first served would run it last, alone, after the 8 queued before it;
    # priority runs it in the second wave: the 5 batch requests left waiting end after it.
    if len(order) - 1 - order.index("interactive") < 4:
        pytest.fail(f"the interactive request did not overtake the batch requests:\n{trace}")


def test_status_shows_the_job_and_the_replica(stack: tuple[Stack, PlatformConfig]) -> None:
    up, _ = stack
    out = subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "status", "--json", "--config", str(up.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    status = json.loads(out.stdout)
    assert status["errors"] == []
    pools = {p["pool"]: p for p in status["pools"]}
    assert sorted(pools) == sorted([MODEL, EMBED, RERANK])
    chat = pools[MODEL]
    assert (chat["desired"], chat["jobs"], chat["serving"], chat["failures"]) == (1, 1, 1, 0)
    (job,) = [j for j in status["jobs"] if j["pool"] == MODEL]
    (replica,) = [r for r in status["replicas"] if r["pool"] == MODEL]
    assert job["state"] == "RUNNING" and job["node"] in ("n1", "n2")
    hours, minutes = map(int, job["time_left"].rstrip("m").split("h"))
    assert hours == 0 and 30 <= minutes <= 59  # a 60 min limit, started minutes ago
    assert replica["job_id"] == job["job_id"] and replica["node"] == job["node"]
    assert {n["node"] for n in status["nodes"]} == {"n1", "n2"}
    assert all(n["gpus"] == "gpu:4" for n in status["nodes"])


def test_down_drains_and_leaves_no_process_behind(stack: tuple[Stack, PlatformConfig]) -> None:
    up, config = stack
    job_logs = list(Path(config.slurm.log_dir).glob(f"hpcserve-{MODEL}-*.out"))
    assert len(list(Path(config.slurm.log_dir).glob("*.out"))) == 3
    assert up.down() == 0
    assert processes_mentioning(str(up.state_dir)) == []
    # Every process of a job has the cluster's SLURM_CONF in its environment, also the vLLM
    # engine core and workers, which rename themselves (VLLM::...).
    assert conf_processes(Path(config.slurm.conf)) == []
    # The engine drained: it deregistered and vLLM exited on its own, cleanly.
    (log,) = job_logs
    text = log.read_text()
    # vLLM loaded the registry version from the node cache, not from the shared source.
    cached = Path(config.engine.cache_dir)
    assert "model tiny-chat@1 staged at " + str(cached) in text
    assert f"--model {cached}/tiny-chat@1-" in text
    assert "stop requested: SIGTERM" in text
    assert "deregistered" in text
    assert "engine stopped (vLLM exit code 0)" in text
    assert "vLLM stopped: drained in " in text
    # Nothing of any job's vLLM is left, by what the processes are: the session vLLM ran
    # in (process group and parentage too), and the job's cgroup (proctrack/cgroup).
    for job_log in Path(config.slurm.log_dir).glob("*.out"):
        sessions = re.findall(r"starting vLLM in session (\d+)", job_log.read_text())
        assert sessions and all(session_processes(int(s)) == [] for s in sessions), job_log
        assert job_cgroup_processes(int(job_log.stem.rsplit("-", 1)[1])) == [], job_log
