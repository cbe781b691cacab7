"""An autoscaled interactive pool on the real two-node Slurm cluster, with simulated engines
that queue like vLLM (--max-num-seqs 2: a third request waits and the engine reports it).

Requests go through the real gateway and router with the official openai client; the pool
manager decides from the load the engines report (poolmgr/autoscale.py). Waits are polls
until the state is seen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts.engine_token import read_token
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.state_files import read_status
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob
from tests.integration.slurm_helpers import cluster_config, wait_for

pytestmark = pytest.mark.slurm

KEY = "sk-autoscale-test"
POOL = {
    "model_path": "/nonexistent",
    "engine": "sim",
    "replicas": 1,
    "engine_args": ["--decode-ms-per-token", "20", "--max-num-seqs", "2"],
    "autoscale": {
        "min": 1,
        "max": 3,
        "target_in_flight": 2,
        "max_waiting_per_replica": 1,
        "scale_up_window_s": 1,  # one late heartbeat is not a burst
        "scale_up_cooldown_s": 0,
        "scale_down_window_s": 2,
        "scale_down_cooldown_s": 2,
    },
}


def jobs(slurm: SlurmCLI) -> list[SlurmJob]:
    return [j for j in slurm.jobs(name_prefix="as-").jobs if j.name == "as-p"]


def active(slurm: SlurmCLI) -> list[SlurmJob]:
    return [j for j in jobs(slurm) if j.state.is_active]


class Clients:
    """Clients that each send one completion after another through the gateway."""

    def __init__(self, http: TestClient, pool: ThreadPoolExecutor) -> None:
        self._client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
        )
        self._pool = pool
        self.ok = 0
        self.errors: list[str] = []

    def start(self, n: int, stop: threading.Event) -> None:
        for _ in range(n):
            self._pool.submit(self._loop, stop)

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                reply = self._client.completions.create(model="p", prompt="x", max_tokens=30)
                assert reply.choices[0].finish_reason == "length"
                self.ok += 1
            except Exception as err:  # every failure is recorded, and asserted on
                self.errors.append(repr(err))


def test_a_burst_scales_up_and_idle_scales_down_through_drain_without_failing_a_request(
    cluster: LocalSlurm,
    slurm: SlurmCLI,
    router: RouterServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "hpcserve.poolmgr")
    config = cluster_config(cluster, router, tmp_path, "as", POOL)
    registry = CollectorRegistry()
    manager = PoolManager(config, slurm, metrics_registry=registry)

    def poll_until(what: str, condition: Callable[[], Any], timeout: float = 120) -> Any:
        def step() -> Any:
            manager.poll_once()
            return condition()

        return wait_for(what, step, timeout=timeout)

    def serving() -> int:
        return sum(1 for r in list_replicas(router.config.routing_bind) if r.pool == "p")

    def in_flight() -> int:
        return sum(r.in_flight for r in list_replicas(router.config.routing_bind) if r.pool == "p")

    poll_until("one serving replica", lambda: serving() == 1)
    gateway = Gateway(
        GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))]),
        routing_endpoint=router.config.routing_bind,
        configured_models={"p"},
        engine_token=read_token(config.engine_token_path()),
    )
    burst, steady = threading.Event(), threading.Event()
    with TestClient(build_app(gateway)) as http, ThreadPoolExecutor(11) as pool:
        clients = Clients(http, pool)
        try:
            # 10 clients at once on one replica that runs 2: 8 wait; the load needs 5 at 2 each.
            clients.start(10, burst)
            wait_for("the burst in flight", lambda: in_flight() >= 8)
            poll_until("three serving replicas", lambda: serving() == 3)
            status = read_status(tmp_path)
            assert status is not None and status.pools[0].autoscale is not None
            up = status.pools[0].autoscale.last_reason
            # Straight to max, once the burst has lasted 1 s: 8+ in flight need 4+ at 2.
            assert up.startswith("up 1->3: ") and " at 2 per replica (max 3)" in up, up
            # The burst ends; one client goes on while the pool drains back to its floor.
            clients.start(1, steady)
            burst.set()
            poll_until("one job left", lambda: len(active(slurm)) == 1)
            served = clients.ok
            wait_for("more requests served", lambda: clients.ok >= served + 5)
        finally:
            burst.set()
            steady.set()
    assert clients.errors == []
    ended = [j for j in jobs(slurm) if not j.state.is_active]
    history = "\n".join(r.getMessage() for r in caplog.records)
    assert [j.state for j in ended] == [JobState.COMPLETED] * 2, history  # drained, not killed
    status = read_status(tmp_path)
    assert status is not None and status.pools[0].autoscale is not None
    assert status.pools[0].autoscale.last_reason.startswith("down 2->1: "), status
    assert status.pools[0].desired == 1

    def decisions(direction: str) -> float | None:
        return registry.get_sample_value(
            "hpcserve_poolmgr_autoscale_decisions_total", {"pool": "p", "direction": direction}
        )

    assert (decisions("up"), decisions("down")) == (1, 2), history
    assert registry.get_sample_value("hpcserve_poolmgr_autoscale_target", {"pool": "p"}) == 1
