"""Tenant limits across two gateway processes hold across a router restart: the new router's
quota book learns the last minute back from the gateways (router/quota_book.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hpcserve.config import RouterConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.routers import (
    count_quota_reports_once_complete,
    loopback_router_config,
    ports_free,
    running_router,
    used_in_quota_book,
)
from tests.services import gateways, sim_engine

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
KEY = "sk-free"


@pytest.fixture
def engine_url() -> Iterator[str]:
    with sim_engine(MODEL, 1) as url:
        yield url


def start_router(config: RouterConfig, engine_url: str) -> Iterator[RouterServer]:
    with running_router(config) as router:
        router.registry.register(p.Register("fast", MODEL, engine_url), now=1e12)
        yield router


def test_limits_hold_across_a_router_restart_under_two_gateways(
    engine_url: str, tmp_path: Path
) -> None:
    config = loopback_router_config(lease_s=600.0)
    gateway = {
        "quota_sync_s": 0.05,
        "route_timeout_s": 1.0,
        "tenants": [{"name": "free", "requests_per_min": 4}],
        "api_keys": [{"tenant": "free", "sha256": hash_api_key(KEY)}],
    }

    def post(url: str) -> int:
        headers = {"Authorization": f"Bearer {KEY}"}
        return httpx.post(
            url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10
        ).status_code

    first = start_router(config, engine_url)
    router = next(first)
    with gateways(config, gateway, tmp_path, model=MODEL) as urls:
        assert [post(urls[0]), post(urls[1]), post(urls[0]), post(urls[1])] == [200] * 4
        wait_for("the book to hold 4 requests", lambda: used_in_quota_book(router) == 4)
        epoch = router.quotas.epoch

        first.close()  # the router stops; a new one starts on the same sockets, book empty
        # The old sockets close in libzmq's I/O thread: the ports free up a moment later.
        wait_for("the router's ports to be free", lambda: ports_free(config))
        second = start_router(config, engine_url)
        router = next(second)
        assert router.quotas.epoch != epoch and used_in_quota_book(router) == 0
        answered = count_quota_reports_once_complete(router, 4)
        # Each gateway sees the new epoch and sends its whole minute back.
        wait_for("the gateways to re-send", lambda: used_in_quota_book(router) == 4)
        wait_for(
            "each gateway to hold the other's totals",
            lambda: len(answered) == 2 and min(answered.values()) >= 2,
        )
        assert [post(urls[0]), post(urls[1])] == [429, 429]
        second.close()
