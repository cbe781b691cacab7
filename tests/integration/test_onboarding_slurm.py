"""Model onboarding end to end on the real two-node Slurm cluster with real vLLM CPU engines.

Three versions of one tiny chat model (`hpcserve models make-tiny`): docs@1 (float32), docs@2
(the same weights stored as float16) and docs@3 (the weights perturbed). docs@1 is in service:
pool `docs` serves it, so `hpcserve models eval` runs it (the baseline) on that replica; docs@2
and docs@3 each start as a Slurm job of the canary pool (`--pool docs`, its shape), so three
engines start in all (at most two at once). Suites run through the gateway with the official
openai client and the verdict is recorded:

1. docs@1 is evaluated on its own (no baseline) with a probe suite and a benchmark; its
   greedy answers become the expected answers of a parity suite; it passes, so its golden
   record is recorded on the pool's replica, which its periodic canary then matches.
2. docs@2 against docs@1 on the parity suite passes (same greedy tokens): its golden record
   is recorded on its eval job's replica, and it is promotable.
3. docs@3 against docs@1 fails the gate (no golden record); `promote` refuses it,
   `--force --reason` moves traffic anyway and leaves an audit line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpcserve.config import PlatformConfig, PoolConfig, dump_config
from hpcserve.modelcache.registry import Registry
from hpcserve.slurm.client import SlurmCLI
from hpcserve.stack import Stack
from tests.integration.slurm_helpers import free_port_block, wait_for
from tests.services import metrics_headers, stack_config

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

API_KEY = "sk-onboarding-test"
PROMPTS = [
    "Bill of lading number",
    "Shipper: ACME Tools GmbH, Stuttgart",
    "Port of loading: Hamburg",
    "Gross weight 18,250 kg",
    "Container MSKU1234565, seal",
    "The consignee is",
]
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformConfig]:
    state = tmp_path_factory.mktemp("onboarding") / "state"
    state.mkdir()
    models = state / "models"
    registry = str(state / "registry.sqlite3")
    variants = {"fp32": [], "fp16": ["--dtype", "float16"], "perturbed": ["--perturb", "0.5"]}
    for name, extra in variants.items():  # docs@1, docs@2, docs@3
        _hpcserve("models", "make-tiny", "--kind", "chat", *extra, str(models / name))
        _hpcserve("models", "add", "docs", str(models / name), "--registry", registry)
    config = stack_config(
        state,
        api_keys={"admin": API_KEY},
        # docs@1 in service; also the canary pool: the shape of an eval replica.
        pools=[
            PoolConfig(name="docs", model_ref="docs@1", replicas=1, engine="vllm-cpu",
                       engine_args=ENGINE_ARGS, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        ],
    )  # fmt: skip
    (state / "hpcserve.toml").write_text(dump_config(config))
    (state / "api-key").write_text(API_KEY + "\n")
    up = Stack(state, slurm_port=free_port_block())
    try:
        assert up.up(launcher="slurm", timeout_s=900) == 0, "hpcserve up failed (see output)"
        yield config
    finally:
        up.down()


def _hpcserve(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", *argv],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"hpcserve {' '.join(argv)}: {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def _eval(
    config: PlatformConfig, ref: str, suite: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    state = Path(config.state_dir)
    return _hpcserve(
        "models", "eval", ref, "--suite", str(suite), "--pool", "docs",
        "--config", str(state / "hpcserve.toml"), "--api-key-file", str(state / "api-key"),
        "--start-timeout", "600", *extra,
        check=False,
    )  # fmt: skip


def _models(config: PlatformConfig, *argv: str) -> subprocess.CompletedProcess[str]:
    return _hpcserve("models", *argv, "--registry", config.registry_path(), check=False)


def _no_eval_job_left(config: PlatformConfig) -> bool:
    slurm = SlurmCLI({**os.environ, "SLURM_CONF": config.slurm.conf})
    return not any(j.state.is_active and "-eval-" in j.name for j in slurm.jobs().jobs)


def _canary_checks(config: PlatformConfig, ref: str, result: str) -> float:
    """The router's count of periodic numerical canaries of `ref` with `result`."""
    headers = metrics_headers(Path(config.state_dir) / "hpcserve.toml")
    url = f"http://127.0.0.1:{config.router.metrics_port}/metrics"
    want = {"model_ref": ref, "stage": "periodic", "result": result}
    for family in text_string_to_metric_families(httpx.get(url, headers=headers).text):
        for sample in family.samples:
            if sample.name == "hpcserve_router_canary_checks_total" and sample.labels == want:
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def parity_suite(stack: PlatformConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs@1 evaluated alone on the pool's replica (probe suite, benchmark); its answers make
    the parity suite."""
    work = tmp_path_factory.mktemp("suites")
    header = {"suite": "probe", "key_metrics": ["answered"], "params": {"temperature": 0}}
    cases = [
        {"id": f"p{i}", "prompt": prompt, "params": {"max_tokens": 12},
         "expect": [{"metric": "answered", "scorer": "regex", "pattern": "."}]}
        for i, prompt in enumerate(PROMPTS)
    ]  # fmt: skip
    probe = work / "probe.jsonl"
    probe.write_text("".join(json.dumps(x) + "\n" for x in [header, *cases]))
    answers = work / "docs-1-answers.jsonl"
    proc = _eval(
        stack, "docs@1", probe, "--answers", str(answers),
        "--bench-requests", "8", "--bench-rate", "4", "--bench-prompt-tokens", "64",
        "--bench-output-tokens", "8",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "verdict: PASS" in proc.stdout
    got = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [a["error"] for a in got] == [""] * len(PROMPTS)
    parity = work / "parity.jsonl"
    header = {"suite": "greedy-parity", "key_metrics": ["greedy_match"],
              "params": {"temperature": 0, "max_tokens": 12}}  # fmt: skip
    cases = [
        {"id": a["id"], "prompt": PROMPTS[i],
         "expect": [{"metric": "greedy_match", "scorer": "exact", "value": a["answer"]}]}
        for i, a in enumerate(got)
    ]  # fmt: skip
    parity.write_text("".join(json.dumps(x) + "\n" for x in [header, *cases]))
    return parity


def test_the_first_version_passes_on_its_own_with_a_benchmark_and_may_be_aliased(
    stack: PlatformConfig, parity_suite: Path
) -> None:
    with Registry(Path(stack.registry_path())) as reg:
        first = reg.latest_evaluation("docs@1")
    assert first is not None and first.passed and first.baseline == ""
    # (a random-weight model may end an answer at once: an empty answer scores 0 here)
    assert 0 < first.scores["answered"] <= 100
    assert first.engine_version == "vllm 0.32.0"
    assert first.engine_args[:2] == ["--dtype", "float32"]
    assert first.served_by.startswith("docs (job ") and first.served_by.endswith("serving")
    bench = first.benchmark
    assert bench is not None and bench.requests == 8 and bench.ok == 8
    # (bursty chunks on a loaded 2-core machine can make the median TPOT round to 0)
    assert bench.ttft_p50_s > 0 and bench.tpot_p90_s >= bench.tpot_p50_s >= 0
    assert bench.output_tokens_per_s > 0
    assert "doc-extraction: 8 requests, Poisson 4/s" in bench.workload
    assert _models(stack, "alias", "extraction", "docs@1").returncode == 0
    # It passed: its golden record was decoded on the pool's replica, whose health monitor
    # then checks it (the record file appeared) and reports a match to the router.
    canary = json.loads(_models(stack, "show", "docs@1").stdout)["canary"]
    assert first.canary.startswith(f"golden record recorded on {canary['recorded_from']} (")
    assert canary["prompts"] == 4 and canary["tokens"] == 64
    wait_for("docs@1's periodic canary", lambda: _canary_checks(stack, "docs@1", "pass"), 300)
    assert _canary_checks(stack, "docs@1", "mismatch") == 0


@pytest.mark.timeout(1500)
def test_the_same_weights_in_float16_pass_parity_and_can_be_promoted(
    stack: PlatformConfig, parity_suite: Path
) -> None:
    proc = _eval(stack, "docs@2", parity_suite, "--baseline", "docs@1", "--no-bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "docs@2 vs docs@1 on suite greedy-parity" in proc.stdout
    assert "docs@1 is served by docs (job " in proc.stderr  # the baseline: no job started
    assert "canary: golden record recorded on http://" in proc.stdout
    shown = json.loads(_models(stack, "show", "docs@2").stdout)
    assert shown["gate"]["passed"] is True
    assert shown["canary"]["prompts"] == 4  # decoded on the eval job's replica
    evaluation = shown["evaluation"]
    assert evaluation["served_by"].startswith("eval-docs-2 (job ")
    assert evaluation["baseline"] == "docs@1"
    assert evaluation["baseline_scores"] == {"greedy_match": 100.0}
    assert evaluation["scores"]["greedy_match"] >= 99.0
    assert evaluation["engine_version"] == evaluation["baseline_engine_version"] == "vllm 0.32.0"
    promoted = _models(stack, "promote", "extraction", "docs@2", "--share", "10")
    assert promoted.returncode == 0, promoted.stderr
    assert promoted.stdout == "extraction -> docs@1 (90%), canary docs@2 (10%)\n"
    assert _no_eval_job_left(stack), "the canary job must end with the evaluation"


@pytest.mark.timeout(1500)
def test_perturbed_weights_fail_the_gate_and_move_only_with_force(
    stack: PlatformConfig, parity_suite: Path
) -> None:
    proc = _eval(stack, "docs@3", parity_suite, "--baseline", "docs@1", "--no-bench")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    assert "verdict: FAIL" in proc.stdout
    assert "canary: not recorded: the version did not pass its gate" in proc.stdout
    shown = json.loads(_models(stack, "show", "docs@3").stdout)
    assert shown["gate"]["passed"] is False and shown["canary"] is None
    assert shown["evaluation"]["scores"]["greedy_match"] < 50
    assert "points below the baseline's 100" in shown["evaluation"]["reasons"][0]
    refused = _models(stack, "promote", "extraction", "docs@3", "--share", "10")
    assert refused.returncode == 2
    assert "docs@3 failed its gate" in refused.stderr and "--force --reason" in refused.stderr
    assert _models(stack, "alias", "extraction", "docs@3").returncode == 2
    forced = _models(
        stack, "promote", "extraction", "docs@3", "--force", "--reason", "test: override"
    )
    assert forced.returncode == 0, forced.stderr
    assert "FORCED (test: override)" in forced.stderr
    audit = json.loads(_models(stack, "show", "extraction").stdout)["audit"]
    assert audit[-1].startswith("promote extraction -> docs@3: share 100%; gate overridden")
    assert _no_eval_job_left(stack)
