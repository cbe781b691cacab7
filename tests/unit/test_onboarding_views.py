"""Where onboarding shows up: the golden record a passing eval records (and `models show`),
the gate column of `models list`, and the rollouts in progress in `hpcserve status`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hpcserve.config import PlatformConfig
from hpcserve.contracts import protocol as p
from hpcserve.contracts.canary import decode_record
from hpcserve.modelcache.cli import cmd_models_list, cmd_models_show
from hpcserve.modelcache.evaluations import Evaluation
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.onboarding.cli import format_evaluation, record_golden_canary
from hpcserve.onboarding.replica import Target
from hpcserve.poolmgr.canary_records import record_path
from hpcserve.poolmgr.rollout import Rollout
from hpcserve.poolmgr.rollout_state import RolloutBook
from hpcserve.status import collect_rollouts, format_status
from tests.unit.modelcache_util import make_model


class Engine(BaseHTTPRequestHandler):
    """vLLM's /v1/completions as the canaries ask it (greedy, logprobs, token ids); with
    `logprobs = False` it answers as an engine without them (the simulated engine)."""

    logprobs = True

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n, k = body["max_tokens"], body["logprobs"]
        logprobs = {
            "tokens": [f"token_id:{10 + i}" for i in range(n)],
            "token_logprobs": [-0.5] * n,
            "top_logprobs": [
                {f"token_id:{10 + i + j}": -0.5 - j for j in range(k)} for i in range(n)
            ],
        }
        choice = {"text": "x" * n, "logprobs": logprobs if self.logprobs else None}
        data = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[tuple[str, type[Engine]]]:
    handler = type("OneEngine", (Engine,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def config(tmp_path: Path) -> PlatformConfig:
    cfg = PlatformConfig(state_dir=str(tmp_path / "state"), registry=str(tmp_path / "reg.sqlite3"))
    src = make_model(tmp_path / "src")
    with Registry(Path(cfg.registry_path())) as reg:
        for _ in range(3):
            reg.add_version("docs", str(src), build_manifest(src))
    return cfg


def target(url: str, ref: str = "docs@2") -> Target:
    load = p.ReplicaLoad()
    replica = p.ReplicaInfo("r1", "eval-docs-2", url, "eval-docs-2", 7, "n1", 1.0, 0.0, 0, load)
    return Target(ref, "eval-docs-2", [replica], job_id=7)


def evaluation(ref: str, passed: bool, **extra: Any) -> Evaluation:
    return Evaluation(
        ref=ref, suite="parity", suite_digest="0" * 64, suite_path="parity.jsonl", cases=1,
        scores={"m": 100.0 if passed else 10.0}, key_metrics=["m"], passed=passed, **extra,
    )  # fmt: skip


def test_a_passing_eval_records_the_golden_record_on_its_replica_once(
    config: PlatformConfig, engine: tuple[str, type[Engine]]
) -> None:
    url, _ = engine
    said: list[str] = []
    note = record_golden_canary(config, "docs@2", target(url), said.append)
    assert note == (
        f"golden record recorded on {url} (4 prompts, 64 tokens, tolerance 0.1): every "
        "replica of docs@2 is checked against it"
    )
    assert said == [f"canary: decoding the golden record of docs@2 on {url}", f"canary: {note}"]
    with Registry(Path(config.registry_path())) as reg:
        record = reg.canary_record("docs@2")
    assert record is not None and record.recorded_from == url
    assert record.answers[0].tokens[0].token_id == 10
    # The file the version's replicas read is there at once (the pool manager keeps it so).
    file = record_path(config.state_dir, "docs@2")
    assert decode_record(file.read_bytes()) == record
    # Evaluated again: the record is golden, so it is kept, and the note says how to renew it.
    again = record_golden_canary(config, "docs@2", target("http://127.0.0.1:1"), said.append)
    assert again == (
        f"kept the golden record recorded on {url} (hpcserve models canary clear docs@2, "
        "then hpcserve models canary record docs@2 --config, to record anew)"
    )
    with Registry(Path(config.registry_path())) as reg:
        assert reg.canary_record("docs@2") == record
    table = format_evaluation(evaluation("docs@2", True, canary=note))
    assert table.splitlines()[-2] == f"canary: {note}"


def test_an_engine_without_logprobs_leaves_no_record_and_says_how_to_make_one(
    config: PlatformConfig, engine: tuple[str, type[Engine]]
) -> None:
    url, handler = engine
    handler.logprobs = False
    note = record_golden_canary(config, "docs@3", target(url, "docs@3"), lambda _: None)
    assert note.startswith(f"not recorded on {url}: /v1/completions: the answer has no ")
    assert note.endswith("(record by hand: hpcserve models canary record docs@3 --config)")
    with Registry(Path(config.registry_path())) as reg:
        assert reg.canary_record("docs@3") is None
    assert not record_path(config.state_dir, "docs@3").exists()


def _run(func: Any, capsys: pytest.CaptureFixture[str], **args: Any) -> str:
    import argparse

    assert func(argparse.Namespace(**args)) == 0
    return capsys.readouterr().out


def test_models_show_names_the_golden_record_and_list_the_gate(
    config: PlatformConfig, engine: tuple[str, type[Engine]], capsys: pytest.CaptureFixture[str]
) -> None:
    registry = config.registry_path()
    shown = json.loads(_run(cmd_models_show, capsys, registry=registry, name="docs@2", files=False))
    assert shown["canary"] is None
    with Registry(Path(registry)) as reg:
        reg.record_evaluation(evaluation("docs@1", True))
        reg.record_evaluation(evaluation("docs@2", True, baseline="docs@1"))
        reg.record_evaluation(evaluation("docs@3", False, baseline="docs@1"))
    record_golden_canary(config, "docs@2", target(engine[0]), lambda _: None)
    shown = json.loads(_run(cmd_models_show, capsys, registry=registry, name="docs@2", files=False))
    canary = shown["canary"]
    assert (canary["recorded_from"], canary["prompts"], canary["tokens"]) == (engine[0], 4, 64)
    assert canary["logprob_tol"] == 0.1 and canary["checked"].startswith("every replica")

    with Registry(Path(registry)) as reg:
        reg.add_version("docs", reg.version("docs@1").source, reg.manifest("docs@1"))  # never run
    out = _run(cmd_models_list, capsys, registry=registry, json=False)
    gates = {line.split()[0]: line for line in out.splitlines()[1:5]}
    assert out.splitlines()[0].split()[4] == "GATE"
    assert "  pass (parity)  " in gates["docs@1"]
    assert "  pass (parity vs docs@1)  " in gates["docs@2"]
    assert "  FAIL (parity vs docs@1)  " in gates["docs@3"]
    assert gates["docs@4"].split()[5] == "-"
    listing = json.loads(_run(cmd_models_list, capsys, registry=registry, json=True))
    assert listing["gates"] == {
        "docs@1": "pass (parity)",
        "docs@2": "pass (parity vs docs@1)",
        "docs@3": "FAIL (parity vs docs@1)",
        "docs@4": "-",
    }


def test_status_shows_the_rollouts_in_progress(config: PlatformConfig) -> None:
    steps = [1, 5, 25, 50, 100]
    with RolloutBook(Path(config.state_dir)).change() as rollouts:
        rollouts["extraction"] = Rollout(
            "extraction", "docs@2", "docs@1", steps, 600.0, state="holding", step=1,
            note="new 412 answers, 0.2% errors; stable 8023 answers, 0.1% errors",
        )  # fmt: skip
        rollouts["chat"] = Rollout("chat", "llm@3", "llm@2", steps, 60.0)  # pending
        rollouts["summaries"] = Rollout(  # finished: `hpcserve rollout status` shows it
            "summaries", "sum@2", "sum@1", steps, 60.0, state="rolled_back", step=2,
            reason="error rate 4.0% > stable 0.1% + 1 point",
        )  # fmt: skip
    rows = collect_rollouts(config)
    assert [(r["alias"], r["state"], r["step"], r["share"]) for r in rows] == [
        ("chat", "pending", "-/5", "0%"),
        ("extraction", "holding", "2/5", "5%"),
    ]
    empty: dict[str, Any] = {"pools": [], "jobs": [], "replicas": [], "nodes": [], "errors": []}
    lines = format_status({**empty, "rollouts": rows}).splitlines()
    assert lines[2].split() == ["ALIAS", "VERSION", "STABLE", "STATE", "STEP", "SHARE", "NOTE"]
    assert lines[3].split() == ["chat", "llm@3", "llm@2", "pending", "-/5", "0%"]
    assert lines[4].split()[:6] == ["extraction", "docs@2", "docs@1", "holding", "2/5", "5%"]
    assert lines[4].endswith("  new 412 answers, 0.2% errors; stable 8023 answers, 0.1% errors")
    assert "ALIAS" not in format_status({**empty, "rollouts": []})
    (Path(config.state_dir) / "rollouts.json").write_text("{not json")
    with pytest.raises(Exception, match="not a rollout state file"):
        collect_rollouts(config)
