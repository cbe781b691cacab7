"""Disaggregated prefill and decode end to end (issue 22), on the real two-node Slurm cluster:
a prefill pool and a decode pool of one model, each one real vLLM CPU engine in its own
Slurm job (the pool manager's rendered job script, the CPU build's KV-transfer connector in
a shared directory), the real router and gateway, the official openai client.

A chat request, then a streamed one, are prefilled on the prefill engine and decoded on the
decode engine, whose own counters show the prompt came by KV transfer and was not computed
(vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} grows by the prompt's
full blocks, "local_compute" by less than one block). Then either side is killed (SIGKILL
to its job, the engine's agent included, so the router still lists it until its lease
lapses): with the decode gone, the request is still answered (served whole by the prefill
engine); with both gone, the client gets a clean 503, never a hang.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, PlatformConfig, hash_api_key, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.contracts.engine_args import STORAGE_CONNECTOR
from hpcserve.contracts.engine_token import auth_headers, read_token
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import cluster_config, running_cluster, wait_for

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """The two-node cluster with a switch topology (topology/tree): both nodes under s1."""
    yield from running_cluster(tmp_path_factory.mktemp("localslurm"), leaf_switch="s1")


KEY = "sk-pd-test"
BLOCK = 128  # vLLM's block size on CPU: the storage connector moves full blocks
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]
# Two engines on one small machine: neither pins its threads to the other's core.
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def pd_config(
    cluster: LocalSlurm, router: RouterServer, tmp_path: Path, model: Path
) -> PlatformConfig:
    """The test cluster's config (slurm_helpers.cluster_config) with a prefill and a decode
    pool of model "tiny" instead of its one pool."""
    base = cluster_config(cluster, router, tmp_path, "pd", {"model_path": str(model)})
    data: dict[str, Any] = msgspec.to_builtins(base)
    kv_dir = tmp_path / "kv"  # the shared filesystem of the two nodes
    kv_dir.mkdir()
    common = {
        "served_model_name": "tiny",
        "model_path": str(model),
        "engine": "vllm-cpu",
        "engine_args": VLLM_ARGS,
        "env": ENGINE_ENV,
        "replicas": 1,
        "kv_transfer_dir": str(kv_dir),
    }
    data["pools"] = [
        {**common, "name": "tiny-prefill", "role": "prefill"},
        {**common, "name": "tiny-decode", "role": "decode"},
    ]
    return parse_config(data)


def counters(url: str, token: str) -> dict[str, float]:
    """The engine's prompt-token counters, summed over label sets by name and source."""
    request = urllib.request.Request(url + "/metrics", headers=auth_headers(token))
    with urllib.request.urlopen(request, timeout=30) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total")):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{")[0]
        if "source=" in key:
            name += ":" + key.split('source="')[1].split('"')[0]
        found[name] = found.get(name, 0.0) + float(value)
    return found


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def document(seed: int) -> list[dict[str, str]]:
    """A long chat prompt (about 950 tokens of the tiny model), different for each seed."""
    items = " ".join(f"item{i} weight {i * seed} kg" for i in range(60))
    return [{"role": "user", "content": f"Bill of lading {seed}. Extract the consignee. {items}"}]


class Serving:
    """Both replicas registered; the gateway in front of them."""

    def __init__(self, router: RouterServer, token: str) -> None:
        self.router = router
        self.token = token
        self.metrics = CollectorRegistry()
        config = GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))])
        gateway = Gateway(
            config,
            routing_endpoint=router.config.routing_bind,
            configured_models={"tiny"},
            metrics_registry=self.metrics,
            engine_token=token,
        )
        self.http = TestClient(build_app(gateway))
        self.client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=self.http, max_retries=0
        )

    def replica(self, role: str) -> p.ReplicaInfo:
        [replica] = [r for r in list_replicas(self.router.config.routing_bind) if r.role == role]
        return replica

    def pd_requests(self, outcome: str) -> float:
        value = self.metrics.get_sample_value(
            "hpcserve_gateway_pd_requests_total",
            {"model": "tiny", "outcome": outcome, "reason": ""},
        )
        return value or 0.0


@pytest.fixture
def serving(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> Iterator[tuple[Serving, PoolManager]]:
    model = make_tiny_model("chat", tmp_path / "models" / "tiny")
    config = pd_config(cluster, router, tmp_path, model)
    manager = PoolManager(config, slurm)

    def both_registered() -> bool:
        manager.poll_once()
        roles = sorted(r.role for r in list_replicas(router.config.routing_bind))
        return roles == ["decode", "prefill"]

    wait_for("a prefill and a decode replica to register", both_registered, timeout=900)
    serving = Serving(router, read_token(config.engine_token_path()))
    with serving.http:
        yield serving, manager


@pytest.mark.vllm
def test_a_chat_request_is_prefilled_on_one_engine_and_decoded_on_the_other(
    serving: tuple[Serving, PoolManager], slurm: SlurmCLI
) -> None:
    s, _manager = serving
    prefill, decode = s.replica("prefill"), s.replica("decode")
    assert prefill.slurm_job_id != decode.slurm_job_id  # a job pair
    assert prefill.switch == decode.switch == "s1"  # Slurm's topology, via the pool manager
    assert {prefill.pool, decode.pool} == {"tiny-prefill", "tiny-decode"}
    for replica in (prefill, decode):  # the connector rendered into the job, registered
        registered = s.router.registry.get(replica.replica_id)
        assert registered is not None and registered.spec.kv_connector == STORAGE_CONNECTOR

    # Whole: the decode engine loads the prompt's full blocks, computes less than a block.
    p_before, d_before = counters(prefill.url, s.token), counters(decode.url, s.token)
    reply = s.client.chat.completions.create(
        model="tiny", messages=document(7), max_tokens=8, temperature=0
    )
    assert reply.usage is not None
    prompt = reply.usage.prompt_tokens
    assert prompt > 4 * BLOCK and reply.choices[0].message.content
    p_after, d_after = counters(prefill.url, s.token), counters(decode.url, s.token)
    moved = delta(d_after, d_before, "vllm:prompt_tokens_by_source_total:external_kv_transfer")
    computed = delta(d_after, d_before, "vllm:prompt_tokens_by_source_total:local_compute")
    assert moved == (prompt - 1) // BLOCK * BLOCK, (d_before, d_after)
    assert computed == prompt - moved < BLOCK
    assert delta(p_after, p_before, "vllm:prompt_tokens_total") == prompt  # computed there
    assert s.pd_requests("transferred") == 1

    # The same answer as the prefill engine gives serving the request whole (greedy).
    whole = openai.OpenAI(
        base_url=prefill.url + "/v1", api_key=s.token, max_retries=0, timeout=120
    ).chat.completions.create(model="tiny", messages=document(7), max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == reply.choices[0].message.content

    # Streamed: the prefill step is whole, the decode streams to the client.
    d_before = counters(decode.url, s.token)
    stream = s.client.chat.completions.create(
        model="tiny",
        messages=document(11),
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [usage] = [c.usage for c in chunks if c.usage is not None]
    assert text and usage.completion_tokens == 16
    d_after = counters(decode.url, s.token)
    moved = delta(d_after, d_before, "vllm:prompt_tokens_by_source_total:external_kv_transfer")
    assert moved == (usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert s.pd_requests("transferred") == 2

    # The decode side dies (engine agent and vLLM at once): the request is still answered,
    # by the prefill engine serving it whole.
    slurm.cancel([decode.slurm_job_id], signal="KILL")
    wait_for("the decode engine to stop answering", lambda: not _answers(decode.url))
    reply = s.client.chat.completions.create(
        model="tiny", messages=document(13), max_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"

    # Both gone: a clean error, at once.
    slurm.cancel([prefill.slurm_job_id], signal="KILL")
    wait_for("the prefill engine to stop answering", lambda: not _answers(prefill.url))
    with pytest.raises(openai.APIStatusError) as failed:
        s.client.chat.completions.create(
            model="tiny", messages=document(17), max_tokens=4, temperature=0
        )
    assert failed.value.status_code in (502, 503)
    assert json.dumps(failed.value.body)  # an OpenAI error body


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5):
            return True
    except OSError:
        return False


def test_the_pool_manager_tells_the_router_the_switch_topology(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> None:
    """`scontrol show topology` on the real cluster, parsed, through the pool manager's
    ListReplicas to the router, which then knows each replica's leaf switch (the decode
    replica's locality: router/policies/pd_roles.py). A simulated engine suffices."""
    assert slurm.topology() == {"n1": "s1", "n2": "s1"}
    pool = {"model_path": "/nonexistent", "engine": "sim", "served_model_name": "sim"}
    manager = PoolManager(cluster_config(cluster, router, tmp_path, "topo", pool), slurm)

    def registered() -> list[p.ReplicaInfo]:
        manager.poll_once()
        return list_replicas(router.config.routing_bind)

    [replica] = wait_for("the replica to register", registered)
    assert replica.node in ("n1", "n2") and replica.switch == "s1"
    assert router.node_switches == {"n1": "s1", "n2": "s1"}
