"""Numerical canaries end to end on the real two-node Slurm cluster with real vLLM CPU engines
(one at a time).

A pool serves tiny@1 from the registry. `hpcserve models canary record tiny@1 --config`
asks the router for that replica and records the golden record on it; the pool manager
brings the record's file beside the job, whose health monitor checks it and it matches.
Then the pool's engine arguments change in a way that alters greedy output (an RMSNorm
epsilon override): the new replica decodes the canaries before it registers, differs,
reports a health finding and fails unregistered; with the site's policy
`numerical_canary = "drain"` the pool manager drains its node with the finding as reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hpcserve.config import HealthConfig, PlatformConfig, dump_config
from hpcserve.contracts.router_client import list_replicas
from hpcserve.localslurm import LocalSlurm
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.state_files import write_override
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import cluster_config, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
# Changes every RMSNorm's output (the tiny model's hidden states are ~0.02): other logits.
CHANGED = ["--hf-overrides", json.dumps({"rms_norm_eps": 1.0})]


def jobs(slurm: SlurmCLI, prefix: str) -> list[SlurmJob]:
    return [j for j in slurm.jobs(name_prefix=prefix + "-").jobs if parse_comment(j.comment)]


def serving_jobs(router: RouterServer) -> set[int]:
    return {r.slurm_job_id for r in list_replicas(router.config.routing_bind)}


@pytest.fixture
def nodes_back(slurm: SlurmCLI) -> Iterator[None]:
    yield
    for node in slurm.nodes():
        if node.drained:
            slurm.resume_node(node.name)


def config_for(
    cluster: LocalSlurm, router: RouterServer, tmp_path: Path, prefix: str, args: list[str]
) -> PlatformConfig:
    pool = {"model_ref": "tiny@1", "engine": "vllm-cpu", "engine_args": args}
    config = cluster_config(
        cluster, router, tmp_path, prefix, pool, engine={"cache_dir": str(tmp_path / "nvme")}
    )
    health = HealthConfig(
        probe_interval_s=1,
        probe_deadline_s=30,
        give_up_s=600,
        actions={"numerical_canary": "drain"},
        check_state_dir=str(tmp_path / "health-state"),
    )
    return msgspec.structs.replace(config, health=health)


def canary_checks(router: RouterServer, stage: str, result: str) -> float:
    value: float = router.metrics.canary_checks.labels("tiny@1", stage, result)._value.get()
    return value


def test_golden_record_then_an_engine_change_is_caught_before_registering(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path, nodes_back: Any
) -> None:
    source = make_tiny_model("chat", tmp_path / "models" / "tiny")
    with Registry(tmp_path / "registry.sqlite3") as registry:
        registry.add_version("tiny", str(source), build_manifest(source))
    config = config_for(cluster, router, tmp_path, "cn1", VLLM_ARGS)
    path = tmp_path / "hpcserve.toml"
    path.write_text(dump_config(config))
    manager = PoolManager(config, slurm)

    def poll_until(what: str, condition: Any, timeout: float = 600) -> Any:
        return wait_for(what, lambda: (manager.poll_once(), condition())[1], timeout=timeout)

    poll_until("a serving replica", lambda: len(serving_jobs(router)) == 1)
    (good,) = serving_jobs(router)
    done = subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "models", "canary", "record", "tiny@1",
         "--config", str(path), "--registry", str(tmp_path / "registry.sqlite3")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    record_file = tmp_path / "canaries" / "tiny@1.json"
    poll_until("the record's file beside the job", record_file.exists, timeout=120)
    poll_until("the replica's periodic canary", lambda: canary_checks(router, "periodic", "pass"))
    assert serving_jobs(router) == {good}

    # The engine arguments change: the job is replaced by one with the new ones.
    write_override(tmp_path, "p", 0)
    poll_until("the good replica drained", lambda: not [j for j in jobs(slurm, "cn1")
                                                        if j.state.is_active])  # fmt: skip
    write_override(tmp_path, "p", 1)
    changed = config_for(cluster, router, tmp_path, "cn1", [*VLLM_ARGS, *CHANGED])
    manager = PoolManager(changed, slurm)
    served: set[int] = set()

    def drained_node() -> str:
        served.update(serving_jobs(router))
        failed = [j for j in jobs(slurm, "cn1") if j.state == JobState.FAILED]
        drained = [n for n in slurm.nodes() if n.drained]
        return drained[0].name if failed and drained else ""

    node = poll_until("a failed job and its node drained", drained_node)
    write_override(tmp_path, "p", 0)  # no more replacements onto the other node
    manager.poll_once()
    (failed,) = [j for j in jobs(slurm, "cn1") if j.state == JobState.FAILED]
    assert failed.job_id not in served, "it never registered"
    (drained,) = [n for n in slurm.nodes() if n.name == node]
    assert drained.reason.startswith("hpcserve: numerical canary mismatch at position ")
    assert canary_checks(router, "before_register", "mismatch") == 1
    log = next((tmp_path / "jobs").glob(f"cn1-p-{failed.job_id}.out")).read_text()
    assert "(check numerical_canary, action drain)" in log
    assert ": not registering" in log and "registering replica" not in log
