"""Health on a real Slurm cluster, with simulated engines and the fake NVML (no GPU here).

Each fake node has its own NVML state file (health.fake_nvml = ".../nvml-{node}.json"),
read by the monitor inside the running job; writing an Xid into it is what the driver
would report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import (
    ApiKey,
    GatewayConfig,
    HealthConfig,
    PlatformConfig,
    dump_config,
    hash_api_key,
)
from hpcserve.contracts.engine_token import read_token
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import SlurmJob, SlurmNode
from tests.integration.slurm_helpers import cluster_config, wait_for

pytestmark = pytest.mark.slurm

KEY = "sk-health-test"
HEALTHY = [{"uuid": f"GPU-{i}"} for i in range(4)]


def write_gpus(tmp_path: Path, node: str, gpus: list[dict[str, Any]]) -> None:
    path = tmp_path / f"nvml-{node}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


def health_config(
    cluster: LocalSlurm, router: RouterServer, tmp_path: Path, prefix: str, **health: Any
) -> PlatformConfig:
    for node in ("n1", "n2"):
        write_gpus(tmp_path, node, HEALTHY)
    pool = {
        "model_path": "/nonexistent",
        "engine": "sim",
        "engine_args": ["--decode-ms-per-token", "10"],
    }
    settings = {
        "fake_nvml": str(tmp_path / "nvml-{node}.json"),
        "probe_interval_s": 0.5,
        "probe_deadline_s": 5,
        "check_state_dir": str(tmp_path / "health-state"),
        **health,
    }
    config = cluster_config(cluster, router, tmp_path, prefix, pool)
    return msgspec.structs.replace(config, health=HealthConfig(**settings))


def node_state(slurm: SlurmCLI, name: str) -> SlurmNode:
    return next(n for n in slurm.nodes() if n.name == name)


def active(slurm: SlurmCLI, prefix: str) -> list[SlurmJob]:
    jobs = slurm.jobs(name_prefix=prefix + "-").jobs
    return [j for j in jobs if parse_comment(j.comment) and j.state.is_active]


def serving_jobs(router: RouterServer) -> set[int]:
    return {r.slurm_job_id for r in list_replicas(router.config.routing_bind)}


class Clients:
    """The official client through the real gateway; retries as the client does (it honours
    the gateway's Retry-After), so a request refused while no replica serves is retried."""

    def __init__(self, router: RouterServer, *, engine_token: str) -> None:
        config = GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))])
        gateway = Gateway(
            config,
            routing_endpoint=router.config.routing_bind,
            configured_models={"p"},
            engine_token=engine_token,  # the pool manager's engines require it
        )
        self.http = TestClient(build_app(gateway))
        self.client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=self.http, max_retries=6
        )
        self.results: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def complete(self, max_tokens: int) -> None:
        try:
            reply = self.client.completions.create(model="p", prompt="x", max_tokens=max_tokens)
            self.results.append(f"{reply.choices[0].finish_reason}:{reply.usage.completion_tokens}")
        except Exception as err:  # every failure is recorded, and asserted on
            self.errors.append(repr(err))

    def start(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def steady(self) -> None:
        while not self._stop.is_set():
            self.complete(5)

    def __enter__(self) -> Clients:
        self.http.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        self.http.__exit__(None, None, None)


@pytest.fixture
def nodes_back(slurm: SlurmCLI) -> Iterator[None]:
    yield
    for node in slurm.nodes():
        if node.drained:
            slurm.resume_node(node.name)


def test_xid_79_takes_the_replica_out_drains_the_node_and_moves_the_capacity(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path, nodes_back: None
) -> None:
    config = health_config(cluster, router, tmp_path, "hx1")
    manager = PoolManager(config, slurm)

    def poll_until(what: str, condition: Any, timeout: float = 60) -> Any:
        return wait_for(what, lambda: (manager.poll_once(), condition())[1], timeout=timeout)

    poll_until("a serving replica", lambda: len(serving_jobs(router)) == 1)
    (job,) = active(slurm, "hx1")
    (node,) = job.nodes
    with Clients(router, engine_token=read_token(config.engine_token_path())) as clients:
        clients.start(clients.steady)
        wait_for("steady traffic", lambda: len(clients.results) >= 5)
        # Requests that run across the fault: 300 tokens at 10 ms each, ~3 s.
        for _ in range(3):
            clients.start(clients.complete, 300)
        wait_for(
            "the long requests running",
            lambda: sum(r.in_flight for r in list_replicas(router.config.routing_bind)) >= 3,
        )
        gpus = [dict(g) for g in HEALTHY]
        gpus[3]["xids"] = [79]
        write_gpus(tmp_path, node, gpus)  # the driver reports Xid 79 on GPU 3

        wait_for("the replica out of routing", lambda: job.job_id not in serving_jobs(router))
        poll_until(
            "the node drained and a replacement serving on the other node",
            lambda: (
                node_state(slurm, node).drained
                and (js := active(slurm, "hx1"))
                and any(
                    j.nodes and j.nodes != [node] and j.job_id in serving_jobs(router) for j in js
                )
            ),
            timeout=60,
        )
        assert node_state(slurm, node).reason == "hpcserve: xid 79 gpu 3"
        wait_for("steady traffic on the replacement", lambda: len(clients.results) >= 20)
    assert clients.errors == []
    assert clients.results.count("length:300") == 3, "in-flight requests finished"
    ended = [j for j in slurm.jobs().jobs if j.job_id == job.job_id]
    assert [j.state.value for j in ended] == ["COMPLETED"], "drained, not killed"
    log = next((tmp_path / "jobs").glob(f"hx1-p-{job.job_id}.out")).read_text()
    assert "health: xid 79 gpu 3 (check xid, action drain)" in log
    assert manager.node_health.actions.labels("drain")._value.get() == 1


def test_xid_79_on_a_worker_node_of_a_two_node_replica_drains_that_node(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path, nodes_back: None
) -> None:
    config = health_config(cluster, router, tmp_path, "hx3")
    (pool,) = config.pools
    two_nodes = msgspec.structs.replace(pool, nodes_per_replica=2, tensor_parallel=2)
    config = msgspec.structs.replace(
        config,
        pools=[two_nodes],
        slurm=msgspec.structs.replace(config.slurm, time_limit_min=30, drain_s=20),
    )
    manager = PoolManager(config, slurm)

    def poll_until(what: str, condition: Any, timeout: float = 60) -> Any:
        return wait_for(what, lambda: (manager.poll_once(), condition())[1], timeout=timeout)

    poll_until("a serving two-node replica", lambda: len(serving_jobs(router)) == 1)
    (job,) = active(slurm, "hx3")
    head, worker = job.nodes
    (replica,) = list_replicas(router.config.routing_bind)
    assert replica.node == head, "rank 0 registers; the worker rank is headless"
    gpus = [dict(g) for g in HEALTHY]
    gpus[3]["xids"] = [79]
    write_gpus(tmp_path, worker, gpus)  # the fault is on the worker rank's node

    wait_for("the replica out of routing", lambda: job.job_id not in serving_jobs(router))
    poll_until("the worker's node drained", lambda: node_state(slurm, worker).drained)
    assert node_state(slurm, worker).reason == "hpcserve: xid 79 gpu 3"
    assert not node_state(slurm, head).drained, "only the faulty node is drained"
    wait_for(
        "the job to end",
        lambda: all(not j.state.is_active for j in slurm.jobs().jobs if j.job_id == job.job_id),
    )
    log = next((tmp_path / "jobs").glob(f"hx3-p-{job.job_id}.out")).read_text()
    assert "health: xid 79 gpu 3 (check xid, action drain)" in log


def run_check(config_path: Path, node: str, gpus_file: Path) -> tuple[int, str]:
    res = subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "health", "check", "--drain",
         "--config", str(config_path), "--node", node, "--fake-nvml", str(gpus_file),
         "--xid-window-s", "0.1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "HPCSERVE_CONFIG": ""},
    )  # fmt: skip
    return res.returncode, res.stdout + res.stderr


def test_health_check_drains_and_auto_resumes_only_its_own_drains(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path, nodes_back: None
) -> None:
    config = health_config(cluster, router, tmp_path, "hx2", auto_resume_after=2)
    config_path = tmp_path / "hpcserve.toml"
    config_path.write_text(dump_config(config))
    gpus_file = tmp_path / "nvml-n2.json"
    faulty = [dict(g) for g in HEALTHY]
    faulty[1]["remapped_rows"] = {"pending": True, "uncorrectable": 1}

    write_gpus(tmp_path, "n2", faulty)
    code, out = run_check(config_path, "n2", gpus_file)
    assert code == 1, out
    assert "drain remap_pending: row remap pending gpu 1 (1 uncorrectable rows)" in out
    reason = "hpcserve: row remap pending gpu 1 (1 uncorrectable rows)"
    assert node_state(slurm, "n2").drained and node_state(slurm, "n2").reason == reason

    write_gpus(tmp_path, "n2", HEALTHY)
    code, out = run_check(config_path, "n2", gpus_file)
    assert code == 0 and "node n2: stays drained: clean check 1 of 2" in out, out
    assert node_state(slurm, "n2").drained
    code, out = run_check(config_path, "n2", gpus_file)
    assert code == 0 and "node n2: resumed after 2 clean checks in a row" in out, out
    assert not node_state(slurm, "n2").drained

    # An admin's drain: never resumed, and its reason never overwritten.
    slurm.drain_node("n2", "bad DIMM, ticket 42")
    for _ in range(3):
        code, out = run_check(config_path, "n2", gpus_file)
        assert code == 0 and "drained by someone else (bad DIMM, ticket 42)" in out, out
    write_gpus(tmp_path, "n2", faulty)
    code, out = run_check(config_path, "n2", gpus_file)
    assert code == 1 and "node n2: already drained (bad DIMM, ticket 42)" in out, out
    state = node_state(slurm, "n2")
    assert state.drained and state.reason == "bad DIMM, ticket 42"
