"""`hpcserve batch-runner`: the batch runner in a process of its own.

Why a process: a gateway that runs batches spends ~1 ms of its event loop per batch
request (tokenizing hand-off, routing round trip, relay, group commit), on the loop and
the CPU its interactive requests need. This process runs them with parts of its own: the
batch store, the runner lock (lock.py, role "process": gateways in "standby" hand it
over), a routing client to the router (batch priority, the same prefix hints), an HTTP
client to the engines, a share of the tenants' `batch_tokens_per_min` (its own quota
gate, synced through the router's quota book like a gateway's) and its own /metrics on
`batch.metrics_port` (behind the metrics token, contracts/metrics_http.py).

New batches: the gateways write them to the store; the runner reads the store's active
batches every second (`runner.POLL_S`), one indexed SQLite query, which also brings
cancels. A batch waits at most that long to start, against minutes to run: cheaper to
build and to trust than a wake-up channel between processes (a missed inotify event, or
a gateway that dies between commit and notify, would stall a batch until the next poll
anyway).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from hpcserve.config import PlatformConfig
from hpcserve.contracts.curve import ensure_keys
from hpcserve.contracts.engine_token import ensure_token
from hpcserve.contracts.metrics_http import start_metrics_server
from hpcserve.contracts.private_files import private_dir
from hpcserve.contracts.zmtp_curve import routing_client_keys
from hpcserve.gateway.batch.execute import RoutedExecutor
from hpcserve.gateway.batch.lock import RunnerLock
from hpcserve.gateway.batch.runner import BatchMetrics, BatchRunner
from hpcserve.gateway.batch.service import loads_from
from hpcserve.gateway.batch.store import BatchStore
from hpcserve.gateway.quota import QuotaGate, keep_quota_synced
from hpcserve.gateway.relay import Relay
from hpcserve.gateway.route_hints import route_hints_for
from hpcserve.gateway.routing_client import RoutingClient
from hpcserve.gateway.usage_log import UsageLog

log = logging.getLogger(__name__)


class RunnerProcess:
    """What `hpcserve batch-runner` holds; started and closed on one event loop."""

    def __init__(self, config: PlatformConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.registry = registry
        gateway = config.gateway
        self.routing = RoutingClient(
            config.router.gateways_dial(),
            timeout_s=gateway.route_timeout_s,
            view_refresh_s=gateway.replica_view_s,
            view_max_age_s=gateway.replica_view_max_age_s,
            curve=routing_client_keys(config.router.curve_dir),
        )
        private_dir(config.state_dir)
        self.relay = Relay(
            upstream_timeout_s=gateway.upstream_timeout_s,
            engine_token=ensure_token(config.engine_token_path()),
        )
        self.quota_id = f"batch-runner:{socket.gethostname()}:{os.getpid()}"
        self.quota = QuotaGate(self.quota_id, stale_after_s=max(5.0, 10 * gateway.quota_sync_s))
        self.quota_sync_failures = Counter(
            "hpcserve_batch_quota_sync_failures_total",
            "Syncs of the tenants' batch token usage with the router that failed",
            registry=registry,
        )
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None
        self.usage = UsageLog(config.usage_dir(), "batch")
        self._quota_sync: asyncio.Task[None] | None = None

    async def start(self) -> None:
        config = self.config
        self.store = await asyncio.to_thread(BatchStore, Path(config.batch_dir()))
        await self.routing.start()
        await self.relay.start()
        hints = await asyncio.to_thread(route_hints_for, config)  # reads tokenizers
        tenants = {t.name: t for t in config.gateway.tenants}
        self.runner = BatchRunner(
            self.store,
            RoutedExecutor(
                self.routing,
                self.relay,
                route_hints=hints,
                configured_models={pool.model for pool in config.pools},
                isolate_tenant_caches=config.gateway.isolate_tenant_caches,
            ),
            config.batch,
            tenants=tenants,
            metrics=BatchMetrics(self.registry),
            model_loads=loads_from(self.routing),
            quota=self.quota,
            lock=RunnerLock(self.store.root, "process", name="batch-runner"),
            usage=self.usage,
        )
        if any(t.batch_tokens_per_min for t in tenants.values()):
            self._quota_sync = asyncio.create_task(
                # As a gateway's: a gateway in standby that takes over sees what this one used.
                keep_quota_synced(
                    self.quota,
                    self.routing,
                    self.quota_id,
                    self.config.gateway.quota_sync_s,
                    self.quota_sync_failures,
                ),
                name="quota-sync",
            )
        await self.runner.start()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.close()
        if self._quota_sync is not None:
            self._quota_sync.cancel()
            await asyncio.gather(self._quota_sync, return_exceptions=True)
        await self.relay.close()
        await self.routing.close()
        if self.store is not None:
            self.store.close()
        self.usage.close()


async def serve(config: PlatformConfig, registry: CollectorRegistry) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    process = RunnerProcess(config, registry)
    try:
        await process.start()
        log.info(
            "batch runner process ready: store %s, router %s, /metrics on port %s",
            config.batch_dir(),
            config.router.gateways_dial(),
            config.batch.metrics_port or "(off)",
        )
        await stop.wait()
        log.info("batch runner process stopping")
    finally:
        await process.close()


def run_batch_runner(config: PlatformConfig) -> int:
    registry = CollectorRegistry()
    ensure_keys(config.router.curve_dir, config.state_dir)  # <state_dir>/curve's, if absent
    if config.batch.metrics_port:
        token = ensure_token(config.metrics_token_path())
        try:  # behind the metrics token, like the gateway's /metrics
            start_metrics_server(config.batch.metrics_port, registry, token)
        except OSError as err:
            log.error("batch.metrics_port %d: %s", config.batch.metrics_port, err.strerror)
            return 2
    try:
        import uvloop
    except ImportError:
        factory = None
    else:
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(config, registry))
    return 0
