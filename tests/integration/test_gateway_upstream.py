"""The real gateway process in front of a simulated engine: what a client's disconnect and a
silent engine do to a request."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hpcserve.config import dump_config, hash_api_key, parse_config
from hpcserve.engine_launch.load import parse_vllm_load
from hpcserve.router.client import list_replicas
from hpcserve.router.server import RouterServer
from tests.ports import free_port

KEY = "sk-upstream-test"


@pytest.fixture
def gateway(router: RouterServer, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    config = parse_config({
        "router": {"registry_bind": router.config.registry_bind,
                   "routing_bind": router.config.routing_bind,
                   "lease_s": router.config.lease_s, "heartbeat_s": router.config.heartbeat_s},
        "gateway": {"port": port, "upstream_timeout_s": 0.5,
                    "api_keys": [{"tenant": "t", "sha256": hash_api_key(KEY)}]},
        "pools": [{"name": "sim", "model_path": "/nonexistent", "engine": "sim"}],
    })  # fmt: skip
    path = tmp_path / "gateway.toml"
    path.write_text(dump_config(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcserve.cli", "gateway", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def running_in_engine(router: RouterServer) -> int:
    (replica,) = list_replicas(router.config.routing_bind)
    return parse_vllm_load(httpx.get(replica.url + "/metrics").text).running


def test_client_disconnect_mid_stream_cancels_the_engine_request(
    engine: subprocess.Popen[str],
    gateway: str,
    router: RouterServer,
) -> None:
    body = {"model": "sim", "prompt": "x", "max_tokens": 1000, "stream": True}  # ~10 s
    with httpx.stream(
        "POST",
        gateway + "/v1/completions",
        json=body,
        timeout=10,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: dropping it would close the stream already
        assert next(lines).startswith("data: ")
        assert running_in_engine(router) == 1
    # The client hung up: the gateway drops the engine connection and the engine stops.
    deadline = time.monotonic() + 3
    while running_in_engine(router) != 0:
        assert time.monotonic() < deadline, "the engine kept generating for a gone client"
        time.sleep(0.05)
    (replica,) = list_replicas(router.config.routing_bind)
    assert replica.in_flight == 0, "the router's in-flight count was released"


def test_an_engine_silent_past_the_upstream_timeout_is_a_504(
    engine: subprocess.Popen[str],
    gateway: str,
) -> None:
    response = httpx.post(
        gateway + "/v1/completions",
        timeout=10,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "sim", "prompt": "x", "max_tokens": 200},
    )  # ~2 s
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout"
    assert "gateway.upstream_timeout_s" in error["message"]
