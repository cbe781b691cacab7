"""One doctor run: gather on the control node, send the node part through a Slurm job,
judge everything with doctor/checks.py."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from hpcserve.config import PlatformConfig
from hpcserve.doctor import checks
from hpcserve.doctor.gather import (
    ModelToCheck,
    NodeRequest,
    engine_key_paths,
    gather_cache,
    gather_clock,
    gather_endpoint,
    gather_keys,
    gather_model,
    gather_nvml,
    gather_private_network,
    gather_slurm,
    gather_vllm,
    models_to_check,
    needed_cache_bytes,
    readable_files,
    router_endpoints,
    slurm_client,
)
from hpcserve.doctor.node_job import run_node_jobs
from hpcserve.doctor.types import CheckResult, NodeFacts, SlurmFacts


def host_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def node_request(config: PlatformConfig, models: list[ModelToCheck]) -> NodeRequest:
    return NodeRequest(
        control_host=socket.gethostname().split(".")[0],
        cache_dir=config.engine.cache_dir,
        endpoints=router_endpoints(config),
        key_paths=engine_key_paths(config),
        models=models,
        python=config.engine.python,
        fake_nvml=config.health.fake_nvml,
        health=config.health,
    )


def gather_node(request: NodeRequest, *, started_at: float) -> NodeFacts:
    """Everything the doctor looks at on a GPU node (what its Slurm job runs)."""
    from hpcserve.health.nvml import fake_state_path

    here = host_name()
    host = socket.gethostname().split(".")[0]
    return NodeFacts(
        host=here,
        slurm_job_id=int(os.environ.get("SLURM_JOB_ID", "0") or 0),
        started_at=started_at,
        clock=gather_clock(),
        cache=gather_cache(request.cache_dir) if request.cache_dir else None,
        endpoints=[
            gather_endpoint(name, ep, here=host, control_host=request.control_host)
            for name, ep in request.endpoints
        ],
        keys=readable_files(request.key_paths),
        nvml=gather_nvml(fake_state_path(request.fake_nvml, node=here), request.health),
        vllm=gather_vllm(request.python),
        private_network=gather_private_network(),
        models=[gather_model(m, digests=False, config=None) for m in request.models],
        finished_at=time.time(),
    )


def run_doctor(
    config: PlatformConfig,
    *,
    service_user: str,
    quick: bool,
    node_targets: list[str],
    node_timeout_s: float,
    hpcserve_bin: str,
    say: Callable[[str], None],
) -> list[CheckResult]:
    """Control-node checks, then one Slurm job per node target ([] = none). With the local
    launcher (no Slurm: engines run on this host) the node checks run here instead."""
    local = config.poolmgr.launcher == "local"
    client = slurm_client(config)
    if local:
        slurm = SlurmFacts(reachable=False)
        results = [
            CheckResult(name, "skip", "poolmgr.launcher is 'local': engines run on this host")
            for name in ("slurm", "slurm_access", "gres")
        ]
    else:
        slurm = gather_slurm(config, client)
        results = [
            checks.check_slurm(slurm, config.slurm.conf),
            *checks.check_slurm_access(slurm.test_submits),
            *checks.check_gres(config, slurm),
        ]
    results += [
        *checks.check_keys(gather_keys(config, service_user)),
        checks.check_clock(gather_clock()),
    ]
    wanted, broken = models_to_check(config)
    registered = [m for m in wanted if m.ref]
    if registered and not quick:
        say(f"reading every file of {len(registered)} model(s) to check digests (--quick: sizes)")
    facts = [gather_model(m, digests=not quick, config=config) for m in wanted]
    results += checks.check_models(broken + facts)
    if not node_targets:
        return results
    if local:
        say("poolmgr.launcher is 'local': running the node checks on this host")
        node = gather_node(node_request(config, wanted), started_at=time.time())
        return results + checks.node_results(config, node, None, needed_cache_bytes(wanted))
    if not slurm.reachable:
        results.append(
            CheckResult(
                "node_job", "skip", "not submitted: Slurm is unreachable (see the slurm check)"
            )
        )
        return results
    runs = run_node_jobs(
        config,
        client,
        node_request(config, wanted),
        node_targets,
        hpcserve_bin=hpcserve_bin,
        timeout_s=node_timeout_s,
        say=say,
    )
    needed = needed_cache_bytes(wanted)
    for run in runs:
        where = run.target or "(any node)"
        if run.facts is None:
            results.append(CheckResult("node_job", "fail", f"node {where}: {run.error}", run.fix))
            continue
        results.append(
            CheckResult(
                "node_job",
                "ok",
                f"job {run.job_id} ran on {run.facts.host} and reported back",
                host=f"node {run.facts.host}",
            )
        )
        results += checks.node_results(config, run.facts, run.times, needed)
    return results


def write_node_facts(request_path: Path, result_path: Path, *, started_at: float) -> int:
    """The job's side: gather, then write the facts (atomically) where the control node
    reads them."""
    import msgspec

    from hpcserve.contracts.private_files import write_private

    request = msgspec.json.decode(request_path.read_bytes(), type=NodeRequest)
    facts = gather_node(request, started_at=started_at)
    write_private(result_path, msgspec.json.encode(facts))  # atomic: replaced by rename
    print(f"hpcserve doctor: facts of {facts.host} written to {result_path}")
    return 0
