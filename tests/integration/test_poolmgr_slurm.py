"""The pool manager's behaviours against a real Slurm cluster and a real router.

The jobs are the real rendered template running the real `hpcserve engine`. Where vLLM is
not the point, the engine is the simulated one (`engine = "sim"`, ready in about a second)
or a vLLM pool whose model path does not exist (it fails at once, the failure under test).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, PlatformConfig, hash_api_key, parse_config
from hpcserve.contracts.engine_token import read_token
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.poolmgr.launchers import LocalLauncher
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.state_files import read_status, write_override
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob
from tests.integration.slurm_helpers import cluster_config, wait_for

pytestmark = pytest.mark.slurm

KEY = "sk-poolmgr-test"
TEMPLATE = Path(__file__).parents[2] / "slurm_templates" / "engine.sbatch"


def make_config(
    cluster: LocalSlurm,
    router: RouterServer,
    tmp_path: Path,
    prefix: str,
    pool: dict[str, Any],
    **sections: dict[str, Any],
) -> PlatformConfig:
    """A pool of simulated engines (10 ms per token) on the test cluster."""
    sim = {
        "model_path": "/nonexistent",
        "engine": "sim",
        "engine_args": ["--decode-ms-per-token", "10"],
    }
    return cluster_config(cluster, router, tmp_path, prefix, sim | pool, **sections)


def ours(slurm: SlurmCLI, prefix: str) -> list[SlurmJob]:
    return [j for j in slurm.jobs(name_prefix=prefix + "-").jobs if parse_comment(j.comment)]


def active(slurm: SlurmCLI, prefix: str) -> list[SlurmJob]:
    return [j for j in ours(slurm, prefix) if j.state.is_active]


def poll_until(manager: PoolManager, what: str, condition, timeout: float = 60):  # type: ignore[no-untyped-def]
    def step():  # type: ignore[no-untyped-def]
        manager.poll_once()
        return condition()

    return wait_for(what, step, timeout=timeout)


def serving_jobs(router: RouterServer) -> set[int]:
    return {r.slurm_job_id for r in list_replicas(router.config.routing_bind)}


class Traffic:
    """Steady requests through the real gateway while the pool changes; counts failures."""

    def __init__(self, router: RouterServer, model: str = "p", *, engine_token: str) -> None:
        config = GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))])
        gateway = Gateway(
            config,
            routing_endpoint=router.config.routing_bind,
            configured_models={model},
            engine_token=engine_token,  # the pool manager's engines require it
        )
        self._http = TestClient(build_app(gateway))
        self.model = model
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._http.__enter__()
        self._thread.start()
        return self

    def _run(self) -> None:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=self._http, max_retries=0
        )
        while not self._stop.is_set():
            try:
                reply = client.completions.create(model=self.model, prompt="x", max_tokens=20)
                assert reply.choices[0].finish_reason == "length"
                self.ok += 1
            except Exception as err:  # every failure is recorded, and asserted on
                self.errors.append(repr(err))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._http.__exit__(None, None, None)


@pytest.fixture
def manager_for(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> Iterator[Any]:
    def make(prefix: str, pool: dict[str, Any] | None = None, **sections: Any) -> PoolManager:
        config = make_config(cluster, router, tmp_path, prefix, pool or {}, **sections)
        return PoolManager(config, slurm)

    yield make


def test_submits_to_size_replaces_failed_jobs_backs_off_and_polls_once(
    manager_for: Any, slurm: SlurmCLI, tmp_path: Path
) -> None:
    manager = manager_for("pm1", {"engine": "vllm-cpu", "replicas": 2, "engine_args": []})
    manager.poll_once()
    assert slurm.calls["squeue"] == 1 and slurm.calls["sbatch"] == 2
    first = ours(slurm, "pm1")
    assert len(first) == 2 and {j.name for j in first} == {"pm1-p"}
    assert len({j.comment for j in first}) == 2, "each job carries its own nonce"

    # The engines fail at once (no model); polls replace them, further and further apart.
    squeues_before, polls = slurm.calls["squeue"], 0

    def poll_and_count() -> bool:
        nonlocal polls
        manager.poll_once()
        polls += 1
        return manager.failures.failures.get("p", 0) >= 3

    wait_for("three failures", poll_and_count, timeout=120)
    assert slurm.calls["squeue"] - squeues_before == polls, "one squeue per poll"
    status = read_status(tmp_path)
    assert status is not None
    (pool,) = status.pools
    assert pool.failures >= 3 and "FAILED" in pool.last_failure
    assert pool.next_submit_in_s is not None
    log = next((tmp_path / "jobs").glob(f"pm1-p-{first[0].job_id}.out")).read_text()
    assert "is not a directory on node" in log and "/nonexistent" in log
    # Backoff: 0.5 s x 2^failures between submissions once failures pile up.
    assert manager.timing().submit_interval(3) == 4.0


def test_scale_up_and_down_without_failing_a_request_in_flight(
    manager_for: Any, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> None:
    manager = manager_for("pm2", {"replicas": 0})
    manager.poll_once()
    assert active(slurm, "pm2") == []
    write_override(tmp_path, "p", 2)
    poll_until(manager, "two serving replicas", lambda: len(serving_jobs(router)) == 2)
    with Traffic(router, engine_token=read_token(manager.config.engine_token_path())) as traffic:
        wait_for("traffic", lambda: traffic.ok >= 5)
        write_override(tmp_path, "p", 1)
        poll_until(manager, "one job left", lambda: len(active(slurm, "pm2")) == 1)
        drained = [j for j in ours(slurm, "pm2") if not j.state.is_active]
        wait_for("more traffic", lambda: traffic.ok >= 15)
    assert traffic.errors == []
    assert [j.state for j in drained] == [JobState.COMPLETED], "drained, not killed"
    assert len(serving_jobs(router)) == 1
    write_override(tmp_path, "p", 0)
    poll_until(manager, "no job left", lambda: active(slurm, "pm2") == [])


def test_walltime_handover_serves_without_a_gap(
    manager_for: Any, slurm: SlurmCLI, router: RouterServer
) -> None:
    # 2 min limit, successor 110 s ahead: the first replica retires ~10 s after it starts.
    manager = manager_for(
        "pm3", {}, slurm={"time_limit_min": 2, "drain_s": 5}, poolmgr={"handover_lead_s": 110}
    )
    poll_until(manager, "the first replica serving", lambda: len(serving_jobs(router)) == 1)
    (first,) = serving_jobs(router)
    with Traffic(router, engine_token=read_token(manager.config.engine_token_path())) as traffic:
        poll_until(
            manager,
            "the successor serving and the first job ended",
            lambda: (
                first not in serving_jobs(router)
                and len(serving_jobs(router)) == 1
                and not any(j.job_id == first and j.state.is_active for j in ours(slurm, "pm3"))
            ),
            timeout=60,
        )
        wait_for("traffic on the successor", lambda: traffic.ok >= 10)
    assert traffic.errors == []
    assert {j.state for j in ours(slurm, "pm3") if j.job_id == first} == {JobState.COMPLETED}


def test_admin_capacity_counts_and_is_never_cancelled(
    manager_for: Any, cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer
) -> None:
    manager = manager_for("pm4", {"replicas": 1})
    exports = ",".join([
        "ALL", "HPCSERVE_MODEL_PATH=/nonexistent", "HPCSERVE_MODEL=p", "HPCSERVE_POOL=p",
        f"HPCSERVE_ROUTER={router.config.registry_bind}", "HPCSERVE_ENGINE=sim",
        f"HPCSERVE_BIN={Path(sys.executable).with_name('hpcserve')}",
        "HPCSERVE_BIND_HOST=127.0.0.1", "HPCSERVE_ADVERTISE_HOST=127.0.0.1",
        "HPCSERVE_HEARTBEAT_S=0.25",
    ])  # fmt: skip
    out = str(Path(manager.config.state_dir) / "admin-%j.out")
    admin_job = slurm.submit(
        TEMPLATE.read_text(), extra_args=["--export", exports, "-J", "admin-llm", "-o", out]
    )
    wait_for("the admin's replica", lambda: serving_jobs(router) == {admin_job})
    for _ in range(3):
        manager.poll_once()
    assert active(slurm, "pm4") == [], "the admin's replica fills the pool"
    write_override(Path(manager.config.state_dir), "p", 0)
    for _ in range(3):
        manager.poll_once()
    assert serving_jobs(router) == {admin_job}, "never cancelled to shrink the pool"
    write_override(Path(manager.config.state_dir), "p", 1)
    slurm.cancel([admin_job])
    poll_until(
        manager,
        "a replacement for the cancelled admin job",
        lambda: len(active(slurm, "pm4")) == 1 and admin_job not in serving_jobs(router),
    )


def test_replica_on_a_drained_node_moves_elsewhere(
    manager_for: Any, slurm: SlurmCLI, router: RouterServer
) -> None:
    manager = manager_for("pm5", {"replicas": 1})
    poll_until(manager, "a serving replica", lambda: len(serving_jobs(router)) == 1)
    (job,) = active(slurm, "pm5")
    (node,) = job.nodes
    slurm.drain_node(node, "xid 79 (test)")
    try:
        poll_until(
            manager,
            "a replica on the other node",
            lambda: (
                (js := active(slurm, "pm5"))
                and len(js) == 1
                and js[0].nodes
                and js[0].nodes != [node]
                and js[0].job_id in serving_jobs(router)
            ),
        )
    finally:
        slurm.resume_node(node)


def test_restart_rebuilds_from_slurm_pending_reason_and_scale_down_cancels_pending(
    manager_for: Any, slurm: SlurmCLI, tmp_path: Path
) -> None:
    blocker = "#!/bin/bash\n#SBATCH --gres=gpu:4\n#SBATCH -J admin-block\nsleep 60\n"
    blockers = [
        slurm.submit(blocker, extra_args=["-o", str(tmp_path / "block-%j.out")]) for _ in range(2)
    ]
    wait_for(
        "the nodes to be busy",
        lambda: all(j.state is JobState.RUNNING for j in slurm.jobs().jobs if j.job_id in blockers),
    )
    manager = manager_for("pm6", {"replicas": 2})
    manager.poll_once()
    wait_for(
        "two jobs pending on Resources or Priority",
        lambda: (
            (js := active(slurm, "pm6"))
            and len(js) == 2
            and all(j.state is JobState.PENDING for j in js)
            and {j.state_reason for j in js} <= {"Resources", "Priority"}
        ),
    )
    manager.poll_once()
    status = read_status(tmp_path)
    assert status is not None and len(status.pools[0].pending) == 2
    assert all(p.split(": ")[1] in ("Resources", "Priority") for p in status.pools[0].pending)

    # A new pool manager (a restart) sees the pool at size and submits nothing.
    restarted = PoolManager(manager.config, slurm)
    before = slurm.calls["sbatch"]
    restarted.poll_once()
    assert slurm.calls["sbatch"] == before

    # Scale to zero: pending jobs are cancelled outright; the admin's jobs are untouched.
    scaled = msgspec.structs.replace(
        manager.config, pools=[msgspec.structs.replace(manager.config.pools[0], replicas=0)]
    )
    PoolManager(scaled, slurm).poll_once()
    wait_for("our jobs cancelled", lambda: active(slurm, "pm6") == [])
    assert all(j.state is JobState.RUNNING for j in slurm.jobs().jobs if j.job_id in blockers)


def test_local_launcher_runs_the_same_script_without_slurm(tmp_path: Path) -> None:
    config = parse_config(
        {
            "state_dir": str(tmp_path),
            "poolmgr": {"launcher": "local", "min_submit_interval_s": 0.5},
            "pools": [{"name": "broken", "model_path": str(tmp_path / "nothing"), "replicas": 1}],
        }
    )
    launcher = LocalLauncher(tmp_path / "jobs")
    manager = PoolManager(config, launcher, router_endpoint=None)
    manager.poll_once()
    (job,) = launcher.jobs().jobs
    assert job.state is JobState.RUNNING and parse_comment(job.comment).pool == "broken"
    wait_for(
        "the local job to fail",
        lambda: launcher._jobs[job.job_id].proc.poll() is not None,
        timeout=20,
    )
    assert launcher.jobs().jobs[0].state is JobState.FAILED
    out = (tmp_path / "jobs" / f"hpcserve-broken-local{job.job_id}.out").read_text()
    assert "is not a directory on node" in out
    # The failed job is forgotten and replaced on the next poll.
    time.sleep(0.5)
    manager.poll_once()
    assert [j.job_id for j in launcher.jobs().jobs] == [job.job_id + 1]
    launcher.shutdown(timeout_s=10)
    assert all(j.state is not JobState.RUNNING for j in launcher.jobs().jobs)


def test_reload_replaces_changed_pools_and_keeps_the_others(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path
) -> None:
    from hpcserve.config import dump_config

    sim = {"model_path": "/nonexistent", "engine": "sim", "replicas": 1}
    config = make_config(cluster, router, tmp_path, "pm7", {})
    two_pools = msgspec.structs.replace(config, pools=[
        msgspec.convert({"name": "keep", **sim}, type(config.pools[0])),
        msgspec.convert({"name": "change", **sim}, type(config.pools[0])),
    ])  # fmt: skip
    path = tmp_path / "hpcserve.toml"
    path.write_text(dump_config(two_pools))
    manager = PoolManager(two_pools, slurm, config_path=path)
    poll_until(manager, "both pools serving", lambda: len(serving_jobs(router)) == 2)
    before = {parse_comment(j.comment).pool: j.job_id for j in active(slurm, "pm7")}

    # A broken config is refused and changes nothing.
    path.write_text(dump_config(two_pools).replace('engine = "sim"', 'engine = "tgi"', 1))
    manager.request_reload()
    manager.poll_once()
    assert manager.config == two_pools

    changed = msgspec.structs.replace(two_pools, pools=[
        two_pools.pools[0],
        msgspec.structs.replace(two_pools.pools[1], engine_args=["--decode-ms-per-token", "1"]),
    ])  # fmt: skip
    path.write_text(dump_config(changed))
    manager.request_reload()
    poll_until(
        manager,
        "the changed pool's replica replaced",
        lambda: (
            (now := {parse_comment(j.comment).pool: j.job_id for j in active(slurm, "pm7")})
            and now.get("change") not in (None, before["change"])
            and now["change"] in serving_jobs(router)
            and len(now) == 2
        ),
    )
    after = {parse_comment(j.comment).pool: j.job_id for j in active(slurm, "pm7")}
    assert after["keep"] == before["keep"], "an unchanged pool keeps its replica"
