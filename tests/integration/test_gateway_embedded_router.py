"""`hpcserve gateway` with `gateway.embed_router` and two workers: no `hpcserve router`
process; worker 0 runs the router (its registry socket takes the engine's registration, its
/metrics port answers) and routes with calls, worker 1 dials its routing socket; chat
requests through the official client reach the engine through either worker."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpcserve.config import dump_config, hash_api_key, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.services import (
    gateway_argv,
    metrics_headers,
    per_worker,
    sim_engine,
    stop,
    wait_healthy,
)

MODEL = "tiny"
KEY = "sk-embedded"
MAX_REQUESTS = 80


@pytest.fixture
def engine_url() -> Iterator[str]:
    with sim_engine(MODEL, 1) as url:
        yield url


def routed_total(metrics_port: int, headers: dict[str, str]) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", headers=headers).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "hpcserve_router_routes_total" and sample.labels["outcome"] == "routed"
    )


def test_the_gateway_runs_the_router_and_both_workers_route_through_it(
    engine_url: str, tmp_path: Path
) -> None:
    registry_bind = f"tcp://127.0.0.1:{free_port()}"
    metrics_port, port = free_port(), free_port()
    config = parse_config({
        "state_dir": str(tmp_path / "state"),
        "router": {"registry_bind": registry_bind,
                   "routing_bind": f"tcp://127.0.0.1:{free_port()}",
                   "lease_s": 600.0, "allow_plain_loopback": True,
                   "metrics_port": metrics_port},
        "gateway": {"port": port, "workers": 2, "embed_router": True, "audit_log": "",
                    "api_keys": [{"tenant": "t", "sha256": hash_api_key(KEY)}]},
        "pools": [{"name": MODEL, "model_path": "/nonexistent", "engine": "sim"}],
    })  # fmt: skip
    path = tmp_path / "gateway.toml"
    path.write_text(dump_config(config))
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(gateway_argv(path), stdout=subprocess.DEVNULL, stderr=log_file)
    agent = RegistryAgent(registry_bind, p.Register("r1", MODEL, engine_url))
    try:
        wait_healthy(url, proc)
        agent.register()  # to the router inside the gateway
        agent.process_replies(30.0)
        assert agent.registered
        headers = metrics_headers(path)
        wait_for("the router's /metrics", lambda: routed_total(metrics_port, headers) == 0)

        def chat() -> str:  # a new client, so a new connection: the kernel picks the worker
            with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
                answer = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            return answer.choices[0].message.content or ""

        def served_by_worker() -> dict[str, float]:
            text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
            return per_worker(
                text, "hpcserve_gateway_requests_total", endpoint="chat", status="200"
            )

        sent = 0
        while sent < MAX_REQUESTS and len(served_by_worker()) < 2:
            assert all(chat() for _ in range(4))
            sent += 4
        served = served_by_worker()
        assert set(served) == {"0", "1"} and sum(served.values()) == sent, served
        # Each request was routed once, by the one router, whichever worker took it.
        assert routed_total(metrics_port, headers) == sent
    finally:
        agent.close()
        stop(proc)
    log = log_path.read_text()
    assert "router embedded in this gateway process" in log
    assert proc.returncode == 0, log[-2000:]
