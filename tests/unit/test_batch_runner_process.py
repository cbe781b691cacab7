"""`hpcserve batch-runner`'s parts in one event loop (gateway/batch/process.py), against a
real router: it runs batches without any gateway (it holds the runner lock, its metrics say
so) and its tenants' batch tokens reach the router's quota book, where a gateway reads them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from hpcserve.config import parse_config
from hpcserve.gateway.batch.limiter import quota_key
from hpcserve.gateway.batch.lock import RunnerLock
from hpcserve.gateway.batch.process import RunnerProcess
from hpcserve.gateway.routing_client import RoutingClient
from hpcserve.router.server import RouterServer


def test_the_runner_process_holds_the_lock_and_shares_its_batch_tokens(
    router: RouterServer, tmp_path: Path
) -> None:
    config = parse_config({
        "state_dir": str(tmp_path),
        "router": {"registry_bind": router.config.registry_bind,
                   "routing_bind": router.config.routing_bind, "allow_plain_loopback": True},
        "gateway": {"tenants": [{"name": "docs", "batch_tokens_per_min": 1000}],
                    "quota_sync_s": 0.05},
        "pools": [{"name": "sim", "model_path": "/nonexistent", "engine": "sim"}],
        "batch": {"metrics_port": 0},
    })  # fmt: skip
    registry = CollectorRegistry()

    async def scenario() -> None:
        process = RunnerProcess(config, registry)
        gateway = RoutingClient(router.config.routing_bind, timeout_s=60.0)
        await process.start()
        await gateway.start()
        try:
            deadline = time.monotonic() + 30
            while registry.get_sample_value("hpcserve_batch_runner_lock_held") != 1:
                assert time.monotonic() < deadline, "the runner process did not take the lock"
                await asyncio.sleep(0.05)
            gateway_side = RunnerLock(tmp_path / "batch", "standby", name="gateway")
            assert gateway_side.runner_present() and not gateway_side.try_take()
            assert gateway_side.holder() == process.runner.lock.identity  # type: ignore[union-attr]
            gateway_side.close()
            process.quota.charge_tokens(quota_key("docs"), 1200)  # what a request used
            while True:  # what a gateway learns at its next quota sync
                totals = await gateway.sync_quota("a-gateway", [])
                seen = {t.tenant: t.tokens for t in totals.tenants}
                if seen.get(quota_key("docs")) == 1200:
                    break
                assert time.monotonic() < deadline, f"the router's book has {seen}"
                await asyncio.sleep(0.05)
        finally:
            await gateway.close()
            await process.close()
        assert registry.get_sample_value("hpcserve_batch_runner_lock_held") == 0
        after = RunnerLock(tmp_path / "batch", "standby", name="gateway")
        assert after.try_take(), "the lock and runner.present went with the process"
        after.close()

    asyncio.run(scenario())
