"""A real router on free loopback ports, served from a thread, for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpcserve.config import RouterConfig
from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry as ModelRegistry
from hpcserve.router.server import RouterServer
from tests.ports import free_port


def loopback_router_config(**overrides: Any) -> RouterConfig:
    settings: dict[str, Any] = {
        "registry_bind": f"tcp://127.0.0.1:{free_port()}",
        "routing_bind": f"tcp://127.0.0.1:{free_port()}",
        # 20 heartbeats: the router runs in the test process, and a process descheduled past
        # the lease expires every replica at once on resuming, before it reads the heartbeats
        # that queued meanwhile. Tests of lease expiry set a short one.
        "lease_s": 5.0,
        "heartbeat_s": 0.25,
        "metrics_port": 0,
        # Plain unless the test gives keys: it runs as one user on loopback (the default,
        # CURVE, is tested with curve_dir in test_router_curve.py and test_routing_curve.py).
        "allow_plain_loopback": not overrides.get("curve_dir"),
        **overrides,
    }
    return RouterConfig(**settings)


@contextmanager
def running_router(config: RouterConfig, **server_args: Any) -> Iterator[RouterServer]:
    server = RouterServer(config, **server_args)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, name="router", daemon=True)
    thread.start()
    try:
        assert server.ready.wait(60)
        yield server
    finally:
        server.stop()
        thread.join(5)


@contextmanager
def router_with_one_replica(lease_s: float) -> Iterator[tuple[RouterConfig, RouterServer]]:
    """A running loopback router with replica "a" of model "docs" registered by a real agent."""
    config = loopback_router_config(lease_s=lease_s)
    with running_router(config) as router:
        agent = RegistryAgent(config.registry_bind, p.Register("a", "docs", "http://127.0.0.1:9"))
        try:
            agent.register()
            agent.process_replies(30.0)
            if not agent.registered:
                raise RuntimeError("replica a did not register with the router within 30 s")
            yield config, router
        finally:
            agent.close()


def used_in_quota_book(router: RouterServer) -> int:
    """Requests of the last minute the router's quota book holds, all gateways together."""
    return sum(t.requests for t in router.quotas.others("nobody", time.monotonic()))


def count_quota_reports_once_complete(router: RouterServer, complete: int) -> dict[str, int]:
    """Per gateway, the quota reports the router answers from now on while its book holds
    `complete` requests. A gateway reports again only once it has the previous answer: at 2,
    it holds the others' totals (whatever time that took on a loaded machine)."""
    answered: dict[str, int] = {}
    report = router.quotas.report

    def counting(msg: p.QuotaReport, now: float) -> p.QuotaTotals:
        totals = report(msg, now)
        if used_in_quota_book(router) == complete:
            answered[msg.gateway_id] = answered.get(msg.gateway_id, 0) + 1
        return totals

    router.quotas.report = counting  # type: ignore[method-assign]
    return answered


def ports_free(config: RouterConfig) -> bool:
    """The router's two ports can be bound again (a restarted router may take them)."""
    for endpoint in (config.registry_bind, config.routing_bind):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, int(port)))
            except OSError:
                return False
    return True


def alias_registry(root: Path) -> Path:
    """A model registry in `root` with versions docs@1 and docs@2 and the alias
    extraction -> docs@1."""
    source = root / "weights"
    source.mkdir()
    (source / "config.json").write_text("{}")
    path = root / "registry.sqlite3"
    with ModelRegistry(path) as reg:
        for _ in range(2):
            reg.add_version("docs", str(source), build_manifest(source))
        reg.set_alias("extraction", "docs@1")
    return path
