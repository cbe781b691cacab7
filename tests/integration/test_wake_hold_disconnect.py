"""A request held for a pool at zero whose client goes away: the real gateway process stops
holding it, so it no longer asks the real router (whose unserved demand would keep the pool
awake), counts it, and frees the tenant's concurrency slot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hpcserve.config import dump_config, hash_api_key, parse_config
from hpcserve.contracts.router_client import replica_list
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.services import gateway_argv, metrics_headers, service

KEY = "sk-wake-hold"
DISCONNECTED = 'hpcserve_gateway_wake_holds_total{model="p",outcome="disconnected"}'


@pytest.fixture
def gateway(router: RouterServer, tmp_path: Path) -> Iterator[str]:
    """The gateway of one pool "p" at zero (no replica registers) whose requests are held
    up to 300 s: far past every wait here, so only a disconnect ends a hold."""
    port = free_port()
    config = parse_config({
        "router": {"registry_bind": router.config.registry_bind,
                   "routing_bind": router.config.routing_bind,
                   "lease_s": router.config.lease_s, "heartbeat_s": router.config.heartbeat_s,
                   "allow_plain_loopback": True},
        "gateway": {"port": port,
                    "api_keys": [{"tenant": "t", "sha256": hash_api_key(KEY)}],
                    "tenants": [{"name": "t", "max_concurrent": 1}]},
        "pools": [{"name": "p", "model_path": "/nonexistent", "engine": "sim", "replicas": 0,
                   "autoscale": {"min": 0, "max": 1, "wake_budget_s": 300}}],
    })  # fmt: skip
    path = tmp_path / "gateway.toml"
    path.write_text(dump_config(config))
    url = f"http://127.0.0.1:{port}"
    with service(gateway_argv(path), url):
        yield url


def metric(gateway: str, tmp_path: Path, name: str) -> float:
    text = httpx.get(gateway + "/metrics", headers=metrics_headers(tmp_path / "gateway.toml")).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)), 0)


def held_then_gone(gateway: str) -> None:
    """A completion whose client gives up waiting after 2 s and closes its connection."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gateway + "/v1/completions",
            json={"model": "p", "prompt": "x", "max_tokens": 2},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=httpx.Timeout(30, read=2),
        )


def test_a_held_request_whose_client_disconnects_is_no_longer_held(
    router: RouterServer, gateway: str, tmp_path: Path
) -> None:
    def unserved_age() -> float | None:
        return replica_list(router.config.routing_bind).unserved.get("p")

    held_then_gone(gateway)
    # Held until then: it asked the router, and the router recorded the demand.
    assert unserved_age() is not None
    wait_for("the hold ended by the disconnect", lambda: metric(gateway, tmp_path, DISCONNECTED))
    # The gateway stopped asking: while it held the request, its Routes came every 0.25 s
    # (the demand's age stayed under a second) and its budget has nearly 300 s left.
    wait_for("no Route for p for 3 s", lambda: (unserved_age() or 0) >= 3.0)
    # The tenant's one concurrent request was given back: a second one is held, not a 429.
    held_then_gone(gateway)
    wait_for("the second hold ended", lambda: metric(gateway, tmp_path, DISCONNECTED) == 2)
    assert metric(gateway, tmp_path, DISCONNECTED.replace("disconnected", "timeout")) == 0
    answered = 'hpcserve_gateway_requests_total{endpoint="completions",model="p",status="499"'
    assert metric(gateway, tmp_path, answered + ',tenant="t"}') == 2
