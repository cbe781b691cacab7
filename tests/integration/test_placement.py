"""Placement by node cache on the real two-node Slurm cluster: engines report their node
cache's entries when they register, and the pool manager pins new replicas of a registry
model to a node that holds it and has room (poolmgr/placement.py).

Measured here: the first replica is forced onto n2 (n1 is full), so only n2's cache holds
the model. Then n1 is freed. The control, a replica of a model no node holds, goes where
Slurm alone puts it: idle n1 (cons_tres takes the first node that fits), though n2 had
room too. Then the pool scales to two: its second replica lands on n2, beside the first,
whose cache holds the model. (The test cluster's nodes have 2 CPUs each: n2 has room for
exactly one more replica after the first.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from hpcserve.config import PoolConfig
from hpcserve.contracts.router_client import list_replicas
from hpcserve.localslurm import LocalSlurm
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import InUseError, Registry
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.placement import free_gpus
from hpcserve.poolmgr.state_files import write_override
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import SlurmJob, SlurmNode
from tests.integration.slurm_helpers import cluster_config, wait_for

pytestmark = pytest.mark.slurm


def _model_dir(path: Path, text: str) -> Path:
    # Weights only: the simulated engine does not read them (no config.json: it then uses
    # its default model).
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(text.encode() * 100_000)
    return path


def _jobs(slurm: SlurmCLI, prefix: str, pool: str) -> list[SlurmJob]:
    return [
        j
        for j in slurm.jobs(name_prefix=f"{prefix}-{pool}").jobs
        if parse_comment(j.comment) and j.state.is_active
    ]


def test_new_replicas_go_to_the_node_whose_cache_holds_the_model(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path, caplog: Any
) -> None:
    with Registry(tmp_path / "registry.sqlite3") as registry:
        for name in ("m", "other"):
            source = _model_dir(tmp_path / f"src-{name}", name)
            registry.add_version(name, str(source), build_manifest(source))
    sim = {"engine": "sim", "engine_args": ["--decode-ms-per-token", "10"]}
    config = cluster_config(
        cluster,
        router,
        tmp_path,
        "pl",
        {"model_ref": "m@1", **sim},
        engine={
            "bind_host": "127.0.0.1",
            "advertise_host": "127.0.0.1",
            "cache_dir": str(tmp_path / "cache" / "{node}"),  # one cache per (local) node
        },
    )
    control = PoolConfig(name="q", model_ref="other@1", replicas=0, **sim)  # type: ignore[arg-type]
    config = msgspec.structs.replace(config, pools=[*config.pools, control])
    manager = PoolManager(config, slurm)
    blocker = slurm.submit(
        "#!/bin/bash\nsleep 600\n",
        extra_args=[
            "--nodelist=n1",
            "--gres=gpu:4",
            "--partition=gpu",
            "--job-name=blocker",
            "--output=/dev/null",
        ],
    )
    try:

        def first_serving() -> list[Any] | None:
            manager.poll_once()
            replicas = [r for r in list_replicas(router.config.routing_bind) if r.pool == "p"]
            return replicas or None

        (first,) = wait_for("the first replica (n1 is full)", first_serving, timeout=60)
        assert first.node == "n2"
        assert any(key.startswith("m@1-") for key in first.cached), first.cached
    finally:
        slurm.cancel([blocker])
    wait_for(
        "n1 to be free",
        lambda: not any(j.job_id == blocker and j.state.is_active for j in slurm.jobs().jobs),
        timeout=60,
    )
    # The control first: a model no node holds goes where Slurm alone puts it.
    caplog.set_level("INFO", logger="hpcserve.poolmgr.manager")
    write_override(tmp_path, "q", 1)

    def control_running() -> list[str] | None:
        manager.poll_once()
        jobs = _jobs(slurm, "pl", "q")
        return jobs[0].nodes if jobs and jobs[0].nodes else None

    control_nodes = wait_for("the control replica", control_running, timeout=60)
    assert control_nodes == ["n1"], "Slurm alone takes the first node that fits"
    write_override(tmp_path, "p", 2)

    def scaled() -> bool:
        manager.poll_once()
        jobs = _jobs(slurm, "pl", "p") + _jobs(slurm, "pl", "q")
        return len(jobs) == 3 and all(j.nodes for j in jobs)

    wait_for("two running replicas of p and one of q", scaled, timeout=60)
    nodes = sorted(n for j in _jobs(slurm, "pl", "p") for n in j.nodes)
    pinned = [r.getMessage() for r in caplog.records if "whose cache holds m@1" in r.message]
    assert nodes == ["n2", "n2"], nodes
    assert len(pinned) == 1, pinned

    # The pool manager recorded which replica serves which version: m@1 cannot be removed.
    def recorded() -> list[tuple[str, str]] | None:
        manager.poll_once()
        with Registry(tmp_path / "registry.sqlite3") as registry:
            usage = registry.usage()
        return usage if len(usage) == 3 else None

    usage = wait_for("the registry to record the 3 replicas", recorded, timeout=60)
    assert sorted(ref for _, ref in usage) == ["m@1", "m@1", "other@1"]
    with Registry(tmp_path / "registry.sqlite3") as registry, pytest.raises(InUseError):
        registry.remove("m@1")
    # The control was submitted without a node list.
    assert [r for r in caplog.records if "pool q: submitted job" in r.message]
    assert not [r for r in caplog.records if "whose cache holds other@1" in r.message]


def _cached_on_n2(
    cluster: LocalSlurm,
    slurm: SlurmCLI,
    router: RouterServer,
    tmp_path: Path,
    name: str,
    *,
    begin: str,
) -> PoolManager:
    """The pool manager of pool `name` (registry model m@1, held back by --begin=`begin`,
    a 1 s pin wait), told that n2's cache holds the model."""
    from hpcserve.modelcache.refs import cache_key

    source = _model_dir(tmp_path / "src-m", "m")
    manifest = build_manifest(source)
    with Registry(tmp_path / "registry.sqlite3") as registry:
        registry.add_version("m", str(source), manifest)
    config = cluster_config(
        cluster,
        router,
        tmp_path,
        name,
        {"model_ref": "m@1", "engine": "sim", "sbatch_args": [f"--begin={begin}"]},
        engine={"cache_dir": str(tmp_path / "cache" / "{node}")},
        poolmgr={"pin_wait_s": 1.0},
    )
    manager = PoolManager(config, slurm, router_endpoint=None)
    manager.cache_inventory.report("n2", [cache_key("m", 1, manifest.digest())])
    return manager


def test_a_pinned_replica_whose_node_is_drained_is_replaced_unpinned(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path, caplog: Any
) -> None:
    """The replica is pinned to n2 (its cache holds the model) and held pending by
    --begin; n2 is drained: after poolmgr.pin_wait_s the job is cancelled and a replacement
    submitted without the pin."""
    manager = _cached_on_n2(cluster, slurm, router, tmp_path, "pw", begin="now+600")
    caplog.set_level("INFO", logger="hpcserve.poolmgr.manager")
    manager.poll_once()
    (pinned,) = _jobs(slurm, "pw", "p")
    assert (pinned.required_nodes, pinned.state_reason) == (["n2"], "BeginTime")
    slurm.drain_node("n2", "pin test")
    try:

        def replaced() -> SlurmJob | None:
            manager.poll_once()
            jobs = _jobs(slurm, "pw", "p")
            return jobs[0] if len(jobs) == 1 and jobs[0].job_id != pinned.job_id else None

        replacement = wait_for("the stranded job's replacement", replaced, timeout=60)
        assert replacement.required_nodes == []
        assert [r for r in caplog.records if "replacing it unpinned" in r.message]
    finally:
        slurm.resume_node("n2")


def test_a_pinned_replica_that_loses_its_node_to_another_job_is_replaced_unpinned(
    cluster: LocalSlurm, slurm: SlurmCLI, router: RouterServer, tmp_path: Path, caplog: Any
) -> None:
    """The replica is pinned to n2 (its cache holds the model) and held back by --begin for
    a few seconds; meanwhile another job takes all of n2's GPUs. n2 stays up, so the pinned
    job pends for its node (reason Resources); after poolmgr.pin_wait_s it is cancelled and
    a replacement submitted without the pin."""
    manager = _cached_on_n2(cluster, slurm, router, tmp_path, "pr", begin="now+4")
    caplog.set_level("INFO", logger="hpcserve.poolmgr.manager")

    def n2_free() -> list[SlurmNode] | None:
        nodes = slurm.nodes()
        free = [n for n in nodes if n.name == "n2" and free_gpus(n) == 4 and n.state == ["IDLE"]]
        return nodes if free else None

    wait_for("n2 to be up and idle", n2_free, timeout=60)
    manager.poll_once()
    (pinned,) = _jobs(slurm, "pr", "p")
    assert (pinned.required_nodes, pinned.state_reason) == (["n2"], "BeginTime")
    blocker = slurm.submit(
        "#!/bin/bash\nsleep 600\n",
        extra_args=["--nodelist=n2", "--gres=gpu:4", "--partition=gpu", "--output=/dev/null"],
    )
    wait_for(
        "the other job to take n2",
        lambda: any(j.job_id == blocker and j.nodes == ["n2"] for j in slurm.jobs().jobs),
        timeout=60,
    )
    reasons: set[str] = set()

    def replaced() -> SlurmJob | None:
        manager.poll_once()
        jobs = _jobs(slurm, "pr", "p")
        reasons.update(j.state_reason for j in jobs if j.job_id == pinned.job_id)
        return jobs[0] if len(jobs) == 1 and jobs[0].job_id != pinned.job_id else None

    replacement = wait_for("the pinned job's replacement", replaced, timeout=60)
    assert replacement.required_nodes == []
    assert reasons & {"Resources", "Priority"}, reasons
    (warning,) = [r.getMessage() for r in caplog.records if "replacing it unpinned" in r.message]
    assert f"job {pinned.job_id}: waited for pinned node n2 (" in warning, warning
