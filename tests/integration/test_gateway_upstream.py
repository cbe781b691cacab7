"""The real gateway process in front of a simulated engine: what a client's disconnect and a
silent engine do to a request."""

from __future__ import annotations

import itertools
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hpcserve.config import dump_config, hash_api_key, parse_config
from hpcserve.contracts.router_client import RouterQueryError, list_replicas
from hpcserve.engine_launch.load import parse_vllm_load
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import ports_free
from tests.services import gateway_argv, metrics_headers, service

KEY = "sk-upstream-test"
METERED_KEY = "sk-upstream-metered"


@pytest.fixture
def gateway(router: RouterServer, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    config = parse_config({
        "router": {"registry_bind": router.config.registry_bind,
                   "routing_bind": router.config.routing_bind,
                   "lease_s": router.config.lease_s, "heartbeat_s": router.config.heartbeat_s,
                   "allow_plain_loopback": True},
        # upstream_timeout_s: a tenth of the silent engine's answer, and 200 of its tokens'
        # time apart, so that no stream stalls past it on a loaded machine
        "gateway": {"port": port, "upstream_timeout_s": 2.0, "route_timeout_s": 1.0,
                    "replica_view_s": 0.2,
                    "api_keys": [{"tenant": "t", "sha256": hash_api_key(KEY)},
                                 {"tenant": "abandoner", "sha256": hash_api_key(METERED_KEY)}],
                    "tenants": [{"name": "t"}, {"name": "abandoner", "tokens_per_min": 20}]},
        "pools": [{"name": "sim", "model_path": "/nonexistent", "engine": "sim"}],
    })  # fmt: skip
    path = tmp_path / "gateway.toml"
    path.write_text(dump_config(config))
    url = f"http://127.0.0.1:{port}"
    with service(gateway_argv(path), url):
        yield url


def running_in_engine(router: RouterServer) -> int:
    (replica,) = list_replicas(router.config.routing_bind)
    return parse_vllm_load(httpx.get(replica.url + "/metrics").text).running


def test_client_disconnect_mid_stream_cancels_the_engine_request(
    engine: subprocess.Popen[str],
    gateway: str,
    router: RouterServer,
    tmp_path: Path,
) -> None:
    # ~60 s: unless the engine stops when the client goes, it still runs after the wait below
    body = {"model": "sim", "prompt": "x", "max_tokens": 6000, "stream": True}
    with httpx.stream(
        "POST",
        gateway + "/v1/completions",
        json=body,
        timeout=10,
        headers={"Authorization": f"Bearer {METERED_KEY}"},
    ) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()  # kept: dropping it would close the stream already
        events = [line for line in itertools.islice(lines, 60) if line.startswith("data: ")]
        assert len(events) == 30, "30 tokens, each event and a blank line"
        # The usage so far that the gateway asked the engine for is not shown to the client.
        assert not any('"usage"' in event for event in events)
        assert running_in_engine(router) == 1
    # The client hung up: the gateway drops the engine connection and the engine stops.
    deadline = time.monotonic() + 30
    while running_in_engine(router) != 0:
        assert time.monotonic() < deadline, "the engine kept generating for a gone client"
        time.sleep(0.05)
    (replica,) = list_replicas(router.config.routing_bind)
    assert replica.in_flight == 0, "the router's in-flight count was released"
    # The tokens produced until the client went away count, in metrics and tokens/min.
    metrics = httpx.get(gateway + "/metrics", headers=metrics_headers(tmp_path / "gateway.toml")).text
    out = 'hpcserve_gateway_tokens_total{direction="out",model="sim",tenant="abandoner"}'
    produced = next(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(out)
    )
    assert produced >= 30
    refused = httpx.post(
        gateway + "/v1/completions",
        json={"model": "sim", "prompt": "x", "max_tokens": 1},
        headers={"Authorization": f"Bearer {METERED_KEY}"},
    )
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["message"].startswith("Tenant 'abandoner' is over its tokens")


def test_an_engine_silent_past_the_upstream_timeout_is_a_504(
    engine: subprocess.Popen[str],
    gateway: str,
) -> None:
    response = httpx.post(
        gateway + "/v1/completions",
        timeout=10,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "sim", "prompt": "x", "max_tokens": 2000},
    )  # ~20 s
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout"
    assert "gateway.upstream_timeout_s" in error["message"]


def test_requests_keep_flowing_on_the_last_known_replicas_while_the_router_is_away(
    engine: subprocess.Popen[str],
    gateway: str,
    router: RouterServer,
) -> None:
    def complete(model: str = "sim") -> int:
        body = {"model": model, "prompt": "x", "max_tokens": 3}
        headers = {"Authorization": f"Bearer {KEY}"}
        return httpx.post(
            gateway + "/v1/completions", json=body, headers=headers, timeout=10
        ).status_code

    assert complete() == 200
    time.sleep(2.0)  # the gateway copies the replica set every 0.2 s (10 times meanwhile)
    router.stop()
    wait_for("the router's sockets closed", lambda: ports_free(router.config))
    with pytest.raises(RouterQueryError):
        list_replicas(router.config.routing_bind, timeout_s=1.0)
    assert [complete() for _ in range(5)] == [200] * 5, "routed on the last known set"
    assert complete("unknown-model") == 503, "nothing known for it: no replica"
