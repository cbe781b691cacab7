"""Numerical canaries against real vLLM (CPU build), one engine at a time.

A replica of tiny@1 (`hpcserve engine`, the engine token required) serves; `hpcserve models
canary record --url` makes its golden record and `check` matches it; once the record's
file appears beside the job, that replica's health monitor checks it and it matches. Then a
replica started with other weights under the same version (a record made after it
started) is taken out of routing by the periodic canary, with a health finding naming the
first differing position.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.contracts.canary_client import load_record
from hpcserve.contracts.engine_token import ensure_token
from hpcserve.contracts.router_client import list_health_events, list_replicas
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr.canary_records import write_record_file
from hpcserve.router.server import RouterServer
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import wait_for
from tests.routers import loopback_router_config, running_router

pytestmark = pytest.mark.vllm

VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]


@pytest.fixture
def prom() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def router(prom: CollectorRegistry) -> Iterator[RouterServer]:
    with running_router(loopback_router_config(lease_s=600.0), metrics_registry=prom) as server:
        yield server


@contextmanager
def engine(
    router: RouterServer, tmp_path: Path, name: str, model: Path, record: Path, token: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    health = {"probe_interval_s": 1, "probe_deadline_s": 30, "give_up_s": 600}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HPCSERVE_HEALTH": json.dumps(health)}
    log_path = tmp_path / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "vllm-cpu",
             "--model-path", str(model), "--served-model-name", "tiny", "--pool", "cv",
             "--model-ref", "tiny@1", "--router", router.config.registry_bind,
             "--bind-host", "127.0.0.1", "--advertise-host", "127.0.0.1",
             "--heartbeat-s", "0.25", "--drain-s", "5", "--engine-token-file", str(token),
             "--canary-record", str(record), "--", *VLLM_ARGS],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(120)


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "models", "canary", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def canary_count(prom: CollectorRegistry, stage: str, result: str) -> float:
    labels = {"model_ref": "tiny@1", "stage": stage, "result": result}
    return prom.get_sample_value("hpcserve_router_canary_checks_total", labels) or 0.0


def test_a_replica_with_other_weights_leaves_routing_on_the_periodic_canary(
    router: RouterServer, prom: CollectorRegistry, tmp_path: Path
) -> None:
    weights = make_tiny_model("chat", tmp_path / "tiny-chat")
    other = make_tiny_model("chat", tmp_path / "tiny-chat-other", seed=1)
    token = tmp_path / "secrets" / "engine-token"
    ensure_token(token)
    registry = tmp_path / "registry.sqlite3"
    with Registry(registry) as reg:
        reg.add_version("tiny", str(weights), build_manifest(weights))
    state = tmp_path / "state"
    record_file = state / "canaries" / "tiny@1.json"
    routing = router.config.routing_bind

    with engine(router, tmp_path, "good", weights, record_file, token) as (proc, log):
        wait_for("the replica to register", lambda: list_replicas(routing) or proc.poll(), 600)
        assert proc.poll() is None, log.read_text()[-3000:]
        (replica,) = list_replicas(routing)
        assert "no golden record at" in log.read_text()

        done = cli("record", "tiny@1", "--url", replica.url, "--engine-token-file", str(token),
                   "--registry", str(registry))  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"recorded the golden record of tiny@1 on {replica.url}: ")
        with Registry(registry) as reg:
            golden = reg.canary_record("tiny@1")
        assert golden is not None and len(golden.answers) == 4
        assert all(len(a.tokens) == 16 and len(a.tokens[0].top) >= 5 for a in golden.answers)

        done = cli("check", "tiny", "--url", replica.url, "--engine-token-file", str(token),
                   "--registry", str(registry))  # fmt: skip
        assert done.returncode == 0 and "matches the golden record of tiny@1" in done.stdout
        done = cli("check", "tiny@1", "--url", replica.url, "--registry", str(registry))
        assert done.returncode == 2 and "answered 401" in done.stderr, "no token, no answer"

        # The pool manager brings the record's file beside the job: checked at once.
        with Registry(registry) as reg:
            write_record_file(reg, state, "tiny@1")
        wait_for("a periodic canary that passes", lambda: canary_count(prom, "periodic", "pass"))
        assert len(list_replicas(routing)) == 1
        assert "numerical canary matches the golden record of tiny@1" in log.read_text()
    wait_for("the good replica gone", lambda: not list_replicas(routing), 120)

    # Other weights under the same version; its record arrives after it registered.
    late_record = tmp_path / "late" / "tiny@1.json"
    with engine(router, tmp_path, "other", other, late_record, token) as (proc, log):
        wait_for(
            "the other replica to register", lambda: list_replicas(routing) or proc.poll(), 600
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        late_record.parent.mkdir()
        late_record.write_bytes(record_file.read_bytes())
        wait_for("the replica out of routing", lambda: not list_replicas(routing), 120)
        assert proc.poll() is None, "out of routing, not stopped (until health.give_up_s)"
        events = [e.finding for e in list_health_events(routing).events]
        (finding,) = [f for f in events if f.check == "numerical_canary"]
        assert finding.action == "stop_routing"
        assert finding.detail.startswith("numerical canary mismatch at position ")
        assert canary_count(prom, "periodic", "mismatch") >= 1
        assert f"health: {finding.detail} (check numerical_canary" in log.read_text()
    assert load_record(late_record) == golden
