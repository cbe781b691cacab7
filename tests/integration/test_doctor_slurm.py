"""`hpcserve doctor` against the real two-node test cluster: the control-node checks, and
the node checks through a real Slurm job (submitted with the pool's partition and GRES,
run by slurmd, reporting back through the state dir), with a running CURVE router and a
registered model. No GPU here: NVML and vLLM's CUDA report "skipped: no GPU", not ok."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hpcserve.config import dump_config
from hpcserve.contracts.curve import generate_keys
from hpcserve.contracts.engine_token import ensure_token
from hpcserve.localslurm import LocalSlurm
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import cluster_config
from tests.routers import loopback_router_config, running_router

pytestmark = pytest.mark.slurm


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """Keys, the engine token and a registered model, as a first install has them."""
    state = tmp_path / "state"
    generate_keys(state / "curve")
    source = tmp_path / "models" / "m"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"w" * 4096)
    with Registry(state / "registry.sqlite3") as registry:
        registry.add_version("m", str(source), build_manifest(source))
    ensure_token(state / "secrets" / "engine-token")
    return state


@pytest.fixture
def curve_router(state: Path) -> Iterator[RouterServer]:
    with running_router(loopback_router_config(curve_dir=str(state / "curve"))) as server:
        yield server


def doctor(
    cluster: LocalSlurm, router: RouterServer, state: Path, *args: str, **slurm: Any
) -> tuple[int, dict[str, Any], str]:
    config = cluster_config(
        cluster,
        router,
        state,
        "doc",
        {"model_ref": "m@1", "engine": "vllm-cpu", "gpus_per_replica": 1},
        engine={"cache_dir": str(state.parent / "nodecache")},
        slurm={"partition": "gpu", **slurm},
    )
    keys = {"curve_dir": router.config.curve_dir, "allow_plain_loopback": False}
    config = msgspec.structs.replace(config, router=msgspec.structs.replace(config.router, **keys))
    path = state / "hpcserve.toml"
    path.write_text(dump_config(config))
    proc = subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "doctor", "--config", str(path), "--json", *args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def by_check(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for check in report["checks"]:
        found.setdefault(check["check"], []).append(check)
    return found


def test_doctor_passes_on_the_test_cluster_and_skips_gpu_checks_honestly(
    cluster: LocalSlurm, curve_router: RouterServer, state: Path
) -> None:
    rc, report, stderr = doctor(cluster, curve_router, state, "--node", "n2")
    checks = by_check(report)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert rc == 0 and not failed, (failed, stderr)
    assert report["exit_status"] == 0
    ok = {name for name, results in checks.items() if all(r["status"] == "ok" for r in results)}
    assert {
        "slurm", "slurm_access", "gres", "curve_keys", "models", "node_job", "clock_skew",
        "cache_dir", "router_endpoint", "engine_keys", "vllm_import",
    } <= ok, report  # fmt: skip
    assert "digests right" in checks["models"][0]["detail"]
    node = [c for c in report["checks"] if c["host"] == "node n2"]
    assert {c["check"] for c in node} >= {"nvml", "vllm_cuda", "cache_dir", "router_endpoint"}
    # No GPU on this machine and no pool on the GPU engine: a distinct status, not a pass.
    for name in ("nvml", "vllm_cuda"):
        (result,) = checks[name]
        assert result["status"] == "skip" and result["detail"].startswith("skipped: no GPU")
    # The clock: ok where the kernel is NTP-disciplined, else a warning; never a failure.
    assert {r["status"] for r in checks["clock"]} <= {"ok", "warn"}
    assert report["summary"]["skip"] >= 2
    # --strict counts the skips: the same install fails it.
    strict_rc, strict, _ = doctor(cluster, curve_router, state, "--no-node", "--strict")
    assert strict_rc == 1 and strict["strict"] is True


def test_doctor_names_a_wrong_partition_and_a_stopped_router_with_their_fixes(
    cluster: LocalSlurm, state: Path
) -> None:
    with running_router(loopback_router_config(curve_dir=str(state / "curve"))) as router:
        pass  # its ports are known; nothing listens there any more
    rc, report, _ = doctor(cluster, router, state, "--no-node", partition="nope")
    checks = by_check(report)
    assert rc == 1 and report["exit_status"] == 1
    (access,) = checks["slurm_access"]
    assert access["status"] == "fail" and "invalid partition" in access["detail"].lower()
    assert "sinfo -s" in access["fix"]
    (gres,) = checks["gres"]
    assert gres["status"] == "fail" and "in partition nope" in gres["detail"]
    rc, report, _ = doctor(cluster, router, state, "--node", "n1")
    endpoint = by_check(report)["router_endpoint"][0]
    assert rc == 1 and endpoint["status"] == "fail" and endpoint["host"] == "node n1"
    assert "connection refused" in endpoint["detail"] and "start the router" in endpoint["fix"]
