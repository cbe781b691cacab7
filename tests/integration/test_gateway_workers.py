"""`hpcserve gateway --workers 2`: two processes on one port (SO_REUSEPORT) that hold a
tenant's limit together (each a gateway of its own to the router's quota book), share the
Batch API runner lock (one holds it), and answer /metrics with both workers' series."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hpcserve.config import dump_config, hash_api_key, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.gateway.batch.lock import LOCK_FILE, read_holder
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import (
    count_quota_reports_once_complete,
    loopback_router_config,
    running_router,
    used_in_quota_book,
)
from tests.services import (
    gateway_argv,
    metrics_headers,
    per_worker,
    sim_engine,
    stop,
    wait_healthy,
)

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
KEY = "sk-free"
LIMIT = 4


@pytest.fixture
def engine_url() -> Iterator[str]:
    with sim_engine(MODEL, 1) as url:
        yield url


def worker_pids(supervisor: int) -> set[int]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return {
        int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    }


def test_two_workers_on_one_port_hold_a_tenants_limit_together(
    engine_url: str, tmp_path: Path
) -> None:
    router_config = loopback_router_config(lease_s=600.0)
    port = free_port()
    config = parse_config({
        "state_dir": str(tmp_path / "state"),
        "router": {"registry_bind": router_config.registry_bind,
                   "routing_bind": router_config.routing_bind,
                   "allow_plain_loopback": True, "metrics_port": 0},
        "gateway": {
            "port": port, "workers": 2, "quota_sync_s": 0.05, "route_timeout_s": 2.0,
            "audit_log": "",
            "tenants": [{"name": "free", "requests_per_min": LIMIT}],
            "api_keys": [{"tenant": "free", "sha256": hash_api_key(KEY)}],
        },
        "batch": {"runner": "gateway"},
        "pools": [{"name": MODEL, "model_path": "/nonexistent", "engine": "sim"}],
    })  # fmt: skip
    path = tmp_path / "gateway.toml"
    path.write_text(dump_config(config))
    url = f"http://127.0.0.1:{port}"

    def post() -> int:  # a new connection each time: the kernel picks the worker
        headers = {"Authorization": f"Bearer {KEY}"}
        return httpx.post(
            url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10
        ).status_code

    with running_router(router_config) as router:
        router.registry.register(p.Register("fast", MODEL, engine_url), now=1e12)
        reporting = count_quota_reports_once_complete(router, 0)
        proc = subprocess.Popen(
            gateway_argv(path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_healthy(url, proc)
            wait_for("two workers", lambda: len(worker_pids(proc.pid)) == 2)
            workers = worker_pids(proc.pid)
            # Each worker is a quota participant of its own.
            wait_for("both workers' quota reports", lambda: len(reporting) == 2)

            assert [post() for _ in range(LIMIT)] == [200] * LIMIT
            wait_for("the book to hold the limit", lambda: used_in_quota_book(router) == LIMIT)
            answered = count_quota_reports_once_complete(router, LIMIT)
            wait_for(
                "each worker to hold the other's totals",
                lambda: len(answered) == 2 and min(answered.values()) >= 2,
            )
            headers = metrics_headers(path)
            codes: list[int] = []

            def refused_by_both() -> bool:
                codes.append(post())
                text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
                rejected = per_worker(text, "hpcserve_gateway_quota_rejections_total")
                return len(rejected) == 2 and min(rejected.values()) > 0

            wait_for("a refusal from each worker", refused_by_both)
            assert set(codes) == {429}, codes
            text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
            served = per_worker(
                text, "hpcserve_gateway_requests_total", endpoint="chat", status="200"
            )
            # However the kernel spread the first requests, a worker that admitted fewer
            # than the limit itself refused: the other worker's usage counted.
            assert sum(served.values()) == LIMIT and min(served.get(w, 0) for w in "01") < LIMIT

            # The Batch API runner lock: one worker holds it.
            batch = Path(config.batch_dir())
            wait_for("a worker to take the runner lock", lambda: bool(read_holder(batch)))
            holder = read_holder(batch)
            assert any(f"pid {pid} " in holder for pid in workers), holder
            fd = os.open(batch / LOCK_FILE, os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        finally:
            stop(proc, timeout_s=60)
        assert proc.returncode == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
