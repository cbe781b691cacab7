"""`hpcserve report` against real Slurm accounting: a cluster of its own with slurmdbd and
MariaDB (LocalSlurmSpec.accounting; the other tests' clusters run none), a pool of simulated
engines run by the pool manager as real Slurm jobs, requests through the real gateway with
the official openai client. The report's GPU-hours are sacct's, its tokens what the clients
received, its cost the configured price times those GPU-hours."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, CostConfig, GatewayConfig, dump_config, hash_api_key
from hpcserve.contracts.engine_token import read_token
from hpcserve.contracts.job_records import FILE_NAME as JOB_RECORDS
from hpcserve.contracts.job_records import read_job_records
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.state_files import write_override
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from tests.integration.slurm_helpers import (
    PROCESSES_GONE_S,
    cluster_config,
    running_cluster,
    wait_for,
)

pytestmark = pytest.mark.slurm

KEYS = {"team-a": "sk-report-a", "team-b": "sk-report-b"}
PRICE, API_IN, API_OUT = 3.0, 0.5, 1.5
PREFIX = "rep"
GPUS = 2


@pytest.fixture(scope="module")
def acct_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    yield from running_cluster(tmp_path_factory.mktemp("acct"), accounting=True)


def _sacct_gpu_hours(cluster: LocalSlurm, name: str) -> tuple[list[int], float]:
    """Job ids and GPU-hours of jobs named `name`, as plain sacct reports them (its own
    elapsed seconds and TRES, not the fields the report reads)."""
    done = subprocess.run(
        ["sacct", "-a", "-X", "-n", "-P", f"--name={name}", "--format=JobIDRaw,ElapsedRaw,AllocTRES"],
        env=cluster.env(),
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    ids, hours = [], 0.0
    for line in done.stdout.splitlines():
        job_id, elapsed, tres = line.split("|")
        gpus = int(dict(p.split("=", 1) for p in tres.split(","))["gres/gpu"])
        ids.append(int(job_id))
        hours += int(elapsed) * gpus / 3600
    return ids, hours


def _report(config_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "report", "--config", str(config_file), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_report_gpu_hours_match_sacct_and_tokens_match_the_clients(
    acct_cluster: LocalSlurm, router: RouterServer, tmp_path: Path
) -> None:
    slurm = SlurmCLI(acct_cluster.env(), timeout_s=30)
    config = cluster_config(
        acct_cluster,
        router,
        tmp_path,
        PREFIX,
        {
            "model_path": "/nonexistent",
            "engine": "sim",
            "engine_args": ["--decode-ms-per-token", "5"],
            "gpus_per_replica": GPUS,
        },
    )
    config = msgspec.structs.replace(
        config,
        cost=CostConfig(
            gpu_hour_price=PRICE, api_price_per_m_input=API_IN, api_price_per_m_output=API_OUT
        ),
    )
    config_file = tmp_path / "hpcserve.toml"
    config_file.write_text(dump_config(config))
    manager = PoolManager(config, slurm)

    def step_until(what: str, condition) -> None:  # type: ignore[no-untyped-def]
        wait_for(what, lambda: (manager.poll_once(), condition())[1], timeout=120)

    step_until("a serving replica", lambda: len(list_replicas(router.config.routing_bind)) == 1)
    gateway = Gateway(
        GatewayConfig(
            api_keys=[ApiKey(tenant=t, sha256=hash_api_key(k)) for t, k in KEYS.items()],
            audit_log="",
            usage_dir=config.usage_dir(),
        ),
        routing_endpoint=router.config.routing_bind,
        configured_models={"p"},
        engine_token=read_token(config.engine_token_path()),
    )
    received: dict[str, list[int]] = {t: [0, 0] for t in KEYS}
    with TestClient(build_app(gateway)) as http:
        for tenant, key in KEYS.items():
            client = openai.OpenAI(
                base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
            )
            for n in range(3 if tenant == "team-a" else 2):
                reply = client.completions.create(
                    model="p", prompt="hello " * (n + 1), max_tokens=8
                )
                assert reply.usage is not None
                received[tenant][0] += reply.usage.prompt_tokens
                received[tenant][1] += reply.usage.completion_tokens
            stream = client.chat.completions.create(
                model="p",
                messages=[{"role": "user", "content": "count"}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [chunk.usage for chunk in stream if chunk.usage is not None]
            assert len(usage) == 1
            received[tenant][0] += usage[0].prompt_tokens
            received[tenant][1] += usage[0].completion_tokens
    assert all(r[0] > 0 and r[1] > 0 for r in received.values())

    # The pool drains and its job ends; slurmdbd then has the job's end.
    write_override(tmp_path, "p", 0)
    step_until("the job to end", lambda: not [j for j in slurm.jobs().jobs if j.is_active])
    manager.poll_once()  # it sees the job ended (squeue shows it for MinJobAge)
    job_name = f"{PREFIX}-p"
    wait_for(
        "sacct to have the job's end",
        lambda: (
            (jobs := slurm.accounting(0, 4e9))
            and all(j.end is not None for j in jobs if j.name == job_name)
        ),
        timeout=PROCESSES_GONE_S,
    )
    job_ids, gpu_hours = _sacct_gpu_hours(acct_cluster, job_name)
    assert len(job_ids) == 1 and gpu_hours > 0
    # The pool manager's own records (the report's source without slurmdbd) agree.
    (record,) = read_job_records(tmp_path / JOB_RECORDS)
    assert (record.job_id, record.gpus, record.state) == (job_ids[0], GPUS, "COMPLETED")
    assert (record.end - record.start) * GPUS / 3600 == pytest.approx(gpu_hours, abs=1e-9)

    html = tmp_path / "report.html"
    done = _report(config_file, "--since", "2h", "--json", "--html", str(html))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["gpu_hours_source"] == "sacct"
    (pool,) = report["pools"]
    assert pool["name"] == "p" and pool["jobs"] == 1
    assert pool["gpu_hours"] == pytest.approx(gpu_hours, abs=1e-9)
    tokens_in = sum(r[0] for r in received.values())
    tokens_out = sum(r[1] for r in received.values())
    assert (pool["prompt_tokens"], pool["completion_tokens"]) == (tokens_in, tokens_out)
    assert pool["requests"] == 7
    assert pool["cost"] == pytest.approx(gpu_hours * PRICE)
    assert pool["cost_per_m_tokens"] == pytest.approx(
        gpu_hours * PRICE / (tokens_in + tokens_out) * 1e6
    )
    assert 0 < pool["utilisation"] < 1  # busy while a request was in flight, not more
    api_cost = (tokens_in * API_IN + tokens_out * API_OUT) / 1e6
    assert pool["api_cost"] == pytest.approx(api_cost)
    tenants = {t["name"]: t for t in report["tenants"]}
    assert sorted(tenants) == sorted(KEYS)
    for tenant, (prompt, completion) in received.items():
        row = tenants[tenant]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
        share = (prompt + completion) / (tokens_in + tokens_out)
        assert row["cost"] == pytest.approx(gpu_hours * PRICE * share)
    assert "<svg" in html.read_text()

    table = _report(config_file, "--since", "2h", "--by", "tenant")
    assert table.returncode == 0, table.stderr
    assert "GPU-hours from: sacct" in table.stdout and "team-b" in table.stdout
