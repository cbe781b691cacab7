"""The simulated engine over its real wire: OpenAI API, /metrics, KV events; and a fleet.

One simulated engine process (the tiny chat model's tokenizer, an H100 roofline 100x
faster than modelled) is driven with the official `openai` client and watched with a real
ZeroMQ subscriber; then a fleet of simulated replicas serves a workload through the real
router and gateway.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import zmq

from bench.simfleet import sim_stack
from bench.workload import SLO, build, run_workload, summarize
from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.router_client import list_replicas
from hpcserve.sim.tokenizer import HFTokenizer
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port

VLLM_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim-engine") / "chat"
    make_tiny_model("chat", path)
    return path


@pytest.fixture(scope="module")
def sim(chat_model: Path) -> Iterator[tuple[str, str, str]]:
    """A simulated engine publishing KV events like vLLM (it binds, the subscriber connects)."""
    port, pub, replay = free_port(), free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv-events",
    }
    argv = [
        sys.executable, "-m", "hpcserve.sim.launch",
        "--model", str(chat_model), "--served-model-name", "tiny",
        "--port", str(port), "--time-scale", "0.01", "--block-size", "16",
        "--kv-events-config", json.dumps(events), "--dtype", "float32",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    try:
        wait_for("the simulated engine", healthy, timeout=60)
        yield url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
        assert proc.stdout is not None
        proc.stdout.close()


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics") as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_openai_client_chat_stream_and_completions(sim: tuple[str, str, str]) -> None:
    url, _, _ = sim
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    assert chat.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[1:-1]] == [None, None, None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    text = client.completions.create(model="tiny", prompt="once upon", max_tokens=3)
    assert text.usage is not None and text.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**7)
    names = metrics(url)
    assert set(VLLM_SERIES) <= set(names), set(VLLM_SERIES) - set(names)
    assert names["vllm:generation_tokens_total"] >= 12


def test_kv_events_carry_the_tokenizers_ids_and_a_repeat_hits_the_cache(
    sim: tuple[str, str, str], chat_model: Path
) -> None:
    url, pub, replay = sim
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(pub)
    messages = [{"role": "user", "content": "shipping document " * 60}]
    expected = HFTokenizer(chat_model).chat_ids(messages)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    stored: list[kw.BlockStored] = []
    seqs: list[int] = []
    try:
        # A PUB drops what it sends before the subscription arrives: send until heard.
        for _ in range(20):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
            if sub.poll(500):
                break
        before = metrics(url)
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        while sub.poll(300):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            seqs.append(kw.decode_seq(seq))
            batch = kw.decode_batch(payload)
            stored += [e for e in batch.events if isinstance(e, kw.BlockStored)]
    finally:
        sub.close(0)
    assert stored, "no BlockStored event"
    first = stored[0]
    assert first.block_size == 16 and first.medium == "GPU"
    assert first.token_ids == expected[: len(first.token_ids)]
    after = metrics(url)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits >= 16 * ((len(expected) - 1) // 16)  # the repeat found every full block
    # Replay: a DEALER asks from the first sequence number heard, gets it back, then END.
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    try:
        dealer.send_multipart(kw.replay_request(seqs[0]))
        replayed = []
        while dealer.poll(5000):
            _, _topic, seq, _payload = dealer.recv_multipart()
            if kw.decode_seq(seq) == -1:
                break
            replayed.append(kw.decode_seq(seq))
    finally:
        dealer.close(0)
    assert replayed[: len(seqs)] == seqs


def test_a_fleet_registers_with_the_router_and_serves_a_workload_through_the_gateway(
    chat_model: Path, tmp_path: Path
) -> None:
    with sim_stack(
        8, model_dir=chat_model, work_dir=tmp_path, time_scale=0.1, policy="least-load"
    ) as stack:
        assert len(list_replicas(stack.routing_endpoint)) == 8
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
        reply = client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        specs = build(
            "system-prompt",
            model=stack.model,
            rate=20,
            requests=40,
            system_tokens=300,
            count_tokens=stack.count_tokens,
        )
        results = asyncio.run(
            run_workload(specs, stack.base_url, model=stack.model, api_key=stack.api_key)
        )
        summary = summarize(results, SLO(ttft_s=60, tpot_s=60))
        assert summary.ok == 40, [r.error for r in results if not r.ok][:3]
        assert summary.goodput == 1.0
        served = stack.engine_metrics()
        assert served["vllm:request_success_total"] == 41
        assert served["vllm:prefix_cache_hits_total"] > 0  # the shared system prompt


def _counters(url: str) -> dict[str, float]:
    """A replica's prompt counters, by source where labelled."""
    with urllib.request.urlopen(url + "/metrics") as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:prompt_tokens", "vllm:nixl_xfer_time_seconds_count")):
            name, value = line.rsplit(" ", 1)
            source = name.partition('source="')[2].partition('"')[0]
            key = name.split("{", 1)[0] + (f":{source}" if source else "")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def test_a_chat_request_is_prefilled_on_a_sim_prefill_replica_and_decoded_without_recompute(
    chat_model: Path, tmp_path: Path
) -> None:
    """Issue 22 on the simulator: the real gateway runs its two steps against a sim prefill
    and a sim decode replica (each with the connector the pool manager renders), and the
    decode's counters show the prompt came over the (modelled) link, none of it computed."""
    with sim_stack(pd=(1, 1), model_dir=chat_model, work_dir=tmp_path, time_scale=0.1) as stack:
        listed = {r.role: r.url for r in list_replicas(stack.routing_endpoint)}
        assert set(listed) == {"prefill", "decode"}
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key)
        messages = [{"role": "user", "content": "bill of lading, port of loading " * 40}]
        source = "vllm:prompt_tokens_by_source_total"
        for stream in (False, True):
            p_before, d_before = _counters(listed["prefill"]), _counters(listed["decode"])
            if stream:
                chunks = list(
                    client.chat.completions.create(
                        model=stack.model,
                        messages=messages,
                        max_tokens=6,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                usage = chunks[-1].usage
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                reply = client.chat.completions.create(
                    model=stack.model, messages=messages, max_tokens=6
                )
                usage, text = reply.usage, reply.choices[0].message.content or ""
            assert usage is not None and usage.completion_tokens == 6 and text
            prompt = usage.prompt_tokens
            p_after, d_after = _counters(listed["prefill"]), _counters(listed["decode"])

            def grew(after: dict[str, float], before: dict[str, float], key: str) -> float:
                return after.get(key, 0.0) - before.get(key, 0.0)

            # Prefilled there (computed, or found in its own prefix cache the second time)...
            assert grew(p_after, p_before, "vllm:prompt_tokens_total") == prompt
            # ...and moved: the decode computed none of it (vLLM recomputes the last token
            # for its logits and counts it transferred, as the sim does).
            assert grew(d_after, d_before, "vllm:prompt_tokens_total") == prompt
            moved = grew(d_after, d_before, f"{source}:external_kv_transfer")
            hit = grew(d_after, d_before, f"{source}:local_cache_hit")
            assert moved + hit == prompt and moved > 0
            assert grew(d_after, d_before, f"{source}:local_compute") == 0
            assert grew(d_after, d_before, "vllm:nixl_xfer_time_seconds_count") == 1
