"""Real Prometheus (Debian's package) scrapes a running stack under traffic, with hpcserve's
rules loaded: every recording rule and every dashboard panel's query returns data, except
the few that need an event this stack does not cause (each named below, with why), and no
alert fires on a healthy stack.

The stack is `hpcserve up --launcher local` with simulated engines (vLLM's wire and metric
names, ready in a second); the engines are found through the pool manager's file_sd targets
(`poolmgr.scrape_targets_file`), as a site's Prometheus finds them on compute nodes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from hpcserve.config import CostConfig, PoolConfig, dump_config
from tests.ports import free_port
from tests.services import stack_config, stop

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-monitoring-test"

# Queries that need an event this healthy, GPU-less stack never has.
NEEDS_AN_EVENT = {
    "DCGM_FI_DEV_GPU_UTIL": "NVIDIA's dcgm-exporter runs only on GPU nodes",
    "DCGM_FI_DEV_FB_USED": "NVIDIA's dcgm-exporter runs only on GPU nodes",
    "DCGM_FI_DEV_POWER_USAGE": "NVIDIA's dcgm-exporter runs only on GPU nodes",
    "DCGM_FI_DEV_XID_ERRORS": "NVIDIA's dcgm-exporter runs only on GPU nodes",
    "hpcserve_router_health_findings_total": "no health check found a fault",
    "hpcserve_health_check_findings_total": "`hpcserve health check` writes a textfile on nodes",
    'status="429"': "no tenant went over a limit",
    "quota_rejections": "no tenant went over a limit",
    "overflow": "no tenant overflowed to an external API",
    "batch_backlog": "no batch pool (role batch) in this stack",
    "batch_replicas": "no batch pool (role batch) in this stack",
    "hpcserve_batch_requests_total": "no Batch API batch ran",
    "hpcserve_batch_tokens_total": "no Batch API batch ran",
    "hpcserve_router_cached_prompt_tokens": "the sim pool has no tokenizer: no prefix hints",
    "autoscale": "no pool of this stack autoscales",
    "hpcserve_gateway_wake_holds_total": "no pool of this stack scales to zero",
    "hpcserve_poolmgr_slurm_errors_total": "no Slurm command failed (the local launcher runs none)",
    "hpcserve_rollout_": "no staged rollout ran (`hpcserve rollout start`)",
    "hpcserve_router_canary_checks_total": "no golden record: simulated engines have no logprobs",
}


def _needs_an_event(expr: str) -> bool:
    return any(marker in expr for marker in NEEDS_AN_EVENT)


def _dashboard_queries() -> list[str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "grafana" / "dashboards.py"), "--exprs"],
        capture_output=True,
        text=True,
        check=True,
    )
    # Grafana fills the variables; "All" is ".*".
    return [
        e.replace("$model", ".*").replace("$pool", ".*").replace("$tenant", ".*")
        for e in json.loads(done.stdout)
    ]


def _hpcserve(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    state = tmp_path_factory.mktemp("monitoring") / "state"
    state.mkdir()
    targets = state.parent / "sd" / "engines.json"
    config = stack_config(
        state,
        api_keys={"team-a": KEY},
        pools=[PoolConfig(name="sim-chat", model_path="/nonexistent", engine="sim", replicas=2)],
        launcher="local",
        drain_s=5,
    )
    config = msgspec.structs.replace(
        config,
        poolmgr=msgspec.structs.replace(config.poolmgr, scrape_targets_file=str(targets)),
        cost=CostConfig(gpu_hour_price=2.0),  # the cost dashboard's price
    )
    (state / "hpcserve.toml").write_text(dump_config(config))
    (state / "demo-api-key").write_text(KEY + "\n")
    try:
        up = _hpcserve(
            "up", "--state-dir", str(state), "--launcher", "local", "--timeout", "240", timeout=300
        )
        assert up.returncode == 0, up.stdout + up.stderr
        yield {"config": config, "state": state, "targets": targets}
    finally:
        down = _hpcserve("down", "--state-dir", str(state), timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(scope="module")
def prometheus(stack: dict[str, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is missing: scripts/bootstrap.sh installs it"
    config = stack["config"]
    home = tmp_path_factory.mktemp("prometheus")
    # The shipped rules, evaluated every second instead of every 30 s.
    rules = (ROOT / "deploy" / "prometheus" / "hpcserve-rules.yml").read_text()
    (home / "hpcserve-rules.yml").write_text(rules.replace("interval: 30s", "interval: 1s"))
    scrape = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["hpcserve-rules.yml"],
        "scrape_configs": [
            {
                "job_name": "hpcserve-gateway",
                "static_configs": [{"targets": [f"127.0.0.1:{config.gateway.port}"]}],
                # The gateway's /metrics names tenants: it asks for the metrics token.
                "authorization": {"credentials_file": config.metrics_token_path()},
            },
            # So do the router's, the pool manager's and the batch runner's.
            {
                "job_name": "hpcserve-router",
                "static_configs": [{"targets": [f"127.0.0.1:{config.router.metrics_port}"]}],
                "authorization": {"credentials_file": config.metrics_token_path()},
            },
            {
                "job_name": "hpcserve-poolmgr",
                "static_configs": [{"targets": [f"127.0.0.1:{config.poolmgr.metrics_port}"]}],
                "authorization": {"credentials_file": config.metrics_token_path()},
            },
            {
                "job_name": "hpcserve-batch",
                "static_configs": [{"targets": [f"127.0.0.1:{config.batch.metrics_port}"]}],
                "authorization": {"credentials_file": config.metrics_token_path()},
            },
            {
                "job_name": "hpcserve-engines",
                "file_sd_configs": [{"files": [str(stack["targets"])], "refresh_interval": "1s"}],
            },
        ],
    }
    (home / "prometheus.yml").write_text(json.dumps(scrape))
    port = free_port()
    log = (home / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (home / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Prometheus not ready after 60 s"
            time.sleep(0.2)
        yield url
    finally:
        stop(proc)
        log.close()


def _query(url: str, expr: str) -> list[dict[str, object]]:
    answer = httpx.get(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10)
    body = answer.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _traffic(config: object) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{config.gateway.port}/v1", api_key=KEY)  # type: ignore[attr-defined]
    for i in range(6):
        client.chat.completions.create(
            model="sim-chat", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=8
        )
        stream = client.chat.completions.create(
            model="sim-chat",
            messages=[{"role": "user", "content": f"stream {i}"}],
            max_tokens=8,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_every_rule_and_panel_query_returns_data_and_no_alert_fires(stack, prometheus):
    config = stack["config"]

    rules = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    recording = [r["query"] for g in rules for r in g["rules"] if r["type"] == "recording"]
    alerts = [r["name"] for g in rules for r in g["rules"] if r["type"] == "alerting"]
    assert len(recording) >= 12 and len(alerts) >= 12
    expected = [e for e in [*recording, *_dashboard_queries()] if not _needs_an_event(e)]

    deadline = time.monotonic() + 120
    while True:
        _traffic(config)
        up = _query(prometheus, "up")
        jobs_up = {r["metric"]["job"] for r in up if r["value"][1] == "1"}
        empty = [e for e in expected if not _query(prometheus, e)]
        targets = json.loads(Path(stack["targets"]).read_text())
        if not empty and len(jobs_up) == 5 and len(targets) == 2:
            break
        assert time.monotonic() < deadline, (
            f"after 120 s, jobs up: {sorted(jobs_up)}; engines in the file_sd targets: "
            f"{len(targets)}; queries without data:\n" + "\n".join(empty)
        )
    assert {g["labels"]["pool"] for g in targets} == {"sim-chat"}
    engines = _query(prometheus, 'up{job="hpcserve-engines"}')
    assert sorted(r["metric"]["replica_id"] for r in engines) == sorted(
        g["labels"]["replica_id"] for g in targets
    )
    assert _query(prometheus, 'sum(rate(hpcserve_gateway_requests_total{status="200"}[1m]))')
    firing = _query(prometheus, 'ALERTS{alertstate="firing"}')
    assert firing == [], firing
