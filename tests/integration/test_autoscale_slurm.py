"""An autoscaled interactive pool on the real two-node Slurm cluster, with simulated engines
that queue like vLLM (--max-num-seqs 2: a third request waits and the engine reports it).

Requests go through the real gateway and router with the official openai client; the pool
manager decides from the load the engines report (poolmgr/autoscale.py). Waits are polls
until the state is seen.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import (
    ApiKey,
    PlatformConfig,
    PoolConfig,
    dump_config,
    hash_api_key,
)
from hpcserve.contracts.router_client import list_replicas
from hpcserve.localslurm import LocalSlurm
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry as ModelRegistry
from hpcserve.poolmgr.cold_start import ColdStarts
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.state_files import read_status
from hpcserve.ports import free_port
from hpcserve.router.adapters import AdapterCatalog, AdapterRouter
from hpcserve.router.aliases import AliasCatalog, AliasRouter
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob
from tests.integration.pool_rig import PoolRig, poll_until
from tests.integration.slurm_helpers import cluster_config, wait_for
from tests.routers import loopback_router_config, running_router
from tests.services import gateway_argv, service

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

    def __init__(self, client: openai.OpenAI, pool: ThreadPoolExecutor) -> None:
        self._client = client
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
    rig: PoolRig,
) -> None:
    config = rig.config("as", POOL)
    registry = CollectorRegistry()
    manager = PoolManager(config, rig.slurm, metrics_registry=registry)

    def serving() -> int:
        return len(rig.serving("p"))

    def in_flight() -> int:
        return sum(r.in_flight for r in rig.serving("p"))

    poll_until(manager.poll_once, "one serving replica", lambda: serving() == 1)
    burst, steady = threading.Event(), threading.Event()
    with rig.openai_client(config, KEY, {"p"}) as client, ThreadPoolExecutor(11) as pool:
        clients = Clients(client, pool)
        try:
            # 10 clients at once on one replica that runs 2: 8 wait; the load needs 5 at 2 each.
            clients.start(10, burst)
            wait_for("the burst in flight", lambda: in_flight() >= 8)
            poll_until(manager.poll_once, "three serving replicas", lambda: serving() == 3)
            status = read_status(rig.state_dir)
            assert status is not None and status.pools[0].autoscale is not None
            up = status.pools[0].autoscale.last_reason
            # Straight to max, once the burst has lasted 1 s: 8+ in flight need 4+ at 2.
            assert up.startswith("up 1->3: ") and " at 2 per replica (max 3)" in up, up
            # The burst ends; one client goes on while the pool drains back to its floor.
            clients.start(1, steady)
            burst.set()
            poll_until(manager.poll_once, "one job left", lambda: len(active(rig.slurm)) == 1)
            served = clients.ok
            wait_for("more requests served", lambda: clients.ok >= served + 5)
        finally:
            burst.set()
            steady.set()
    assert clients.errors == []
    ended = [j for j in jobs(rig.slurm) if not j.state.is_active]
    history = rig.history()
    assert [j.state for j in ended] == [JobState.COMPLETED] * 2, history  # drained, not killed
    status = read_status(rig.state_dir)
    assert status is not None and status.pools[0].autoscale is not None
    assert status.pools[0].autoscale.last_reason.startswith("down 2->1: "), status
    assert status.pools[0].desired == 1

    def decisions(direction: str) -> float | None:
        return registry.get_sample_value(
            "hpcserve_poolmgr_autoscale_decisions_total", {"pool": "p", "direction": direction}
        )

    assert (decisions("up"), decisions("down")) == (1, 2), history
    assert registry.get_sample_value("hpcserve_poolmgr_autoscale_target", {"pool": "p"}) == 1


ZERO_POOL = {
    "model_path": "/nonexistent",
    "engine": "sim",
    "replicas": 0,  # it starts asleep
    "engine_args": ["--decode-ms-per-token", "5"],
    # idle_s: long enough that the demand of a request answered 503 is still fresh at the
    # next poll of a loaded machine; the hold budget: far above a sim job's cold start here.
    "autoscale": {"min": 0, "max": 1, "idle_s": 10, "scale_down_cooldown_s": 0,
                  "wake_budget_s": 120},
}  # fmt: skip


class Polling:
    """The pool manager's loop in a thread, as `hpcserve poolmgr` runs it; pausable."""

    def __init__(self, manager: PoolManager) -> None:
        self.manager = manager
        self.on = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="poolmgr", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.3):
            if self.on.is_set():
                self.manager.poll_once()

    def __enter__(self) -> Polling:
        self.on.set()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def test_a_pool_at_zero_wakes_on_the_first_request_serves_it_and_goes_back_to_zero(
    rig: PoolRig,
) -> None:
    def with_gateway(config: PlatformConfig) -> PlatformConfig:
        keys = [ApiKey(tenant="t", sha256=hash_api_key(KEY))]
        gateway = msgspec.structs.replace(config.gateway, api_keys=keys, port=free_port())
        return msgspec.structs.replace(config, gateway=gateway)

    config = with_gateway(rig.config("zero", ZERO_POOL))
    # A second gateway whose hold budget is 1 s: past it, 503 with Retry-After.
    short_pool = {**ZERO_POOL, "autoscale": {**ZERO_POOL["autoscale"], "wake_budget_s": 1}}
    short = with_gateway(rig.config("zero", short_pool))
    (rig.state_dir / "gw.toml").write_text(dump_config(config))
    (rig.state_dir / "gw-short.toml").write_text(dump_config(short))
    manager = PoolManager(config, rig.slurm, metrics_registry=CollectorRegistry())

    def ours() -> list[SlurmJob]:
        return [j for j in rig.slurm.jobs(name_prefix="zero-").jobs if j.name == "zero-p"]

    def autoscale_status() -> Any:
        status = read_status(rig.state_dir)
        return status.pools[0].autoscale if status is not None else None

    def reason_starts(prefix: str) -> Callable[[], bool]:
        return lambda: (
            (auto := autoscale_status()) is not None and auto.last_reason.startswith(prefix)
        )

    url = f"http://127.0.0.1:{config.gateway.port}"
    short_url = f"http://127.0.0.1:{short.gateway.port}"
    with (
        service(gateway_argv(rig.state_dir / "gw.toml"), url),
        service(gateway_argv(rig.state_dir / "gw-short.toml"), short_url),
        Polling(manager) as polling,
    ):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        wait_for("the pool manager at zero", lambda: autoscale_status() is not None)
        auto = autoscale_status()
        assert (auto.target, auto.now) == (0, "at zero: no request since it scaled to zero")
        assert ours() == []
        # /v1/models still lists the model, with no replica.
        listed = [(m.id, (m.model_extra or {}).get("replicas")) for m in client.models.list().data]
        assert listed == [("p", 0)]
        # The first request wakes it: held (a stream shows nothing until its first token)
        # while Slurm starts a replica, then served.
        stream = client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].choices[-1].finish_reason == "length"
        up = autoscale_status().last_reason
        assert up.startswith("up 0->1: a request found no replica"), up
        (job,) = ours()
        # Its cold start, measured from this job (queue wait, then start-up until the router
        # listed it), is in the status and kept in the state dir for the next start.
        status = wait_for("the cold start measured", lambda: (s := read_status(rig.state_dir)) and
                          s.pools[0].cold_start and s)  # fmt: skip
        assert "p90 (median queue" in status.pools[0].cold_start and "1 job(s)" in (
            status.pools[0].cold_start
        )
        assert ColdStarts(rig.state_dir).samples["p"][0].job_id == job.job_id
        # The engine's TTFT and TPOT histograms come with its heartbeats (the SLO signal's
        # source), the TPOT's with its sum (the measured batch limit's mean).
        wait_for("the TTFT and TPOT histograms on a heartbeat", lambda: any(
            r.load.ttft is not None and r.load.ttft.total >= 1
            and r.load.tpot is not None and r.load.tpot.total >= 1 and r.load.tpot.sum > 0
            for r in rig.serving("p")))  # fmt: skip
        # No request for idle_s: it drains back to zero (the job ends COMPLETED, not killed).
        wait_for("scaled to zero", reason_starts("down 1->0: no request for "), timeout=120)
        done = wait_for("the job drained", lambda: [j for j in ours() if not j.state.is_active])
        assert [(j.job_id, j.state) for j in done] == [(job.job_id, JobState.COMPLETED)]
        # With the pool manager paused, nothing can wake the pool within a budget of 1 s:
        # 503, Retry-After, an OpenAI-style error body.
        polling.on.clear()
        reply = httpx.post(
            short_url + "/v1/completions",
            json={"model": "p", "prompt": "x", "max_tokens": 4},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"] == "5"
        error = reply.json()["error"]
        assert (error["code"], error["type"]) == ("model_starting", "server_error"), error
        assert "was scaled to zero and is starting; no replica came within 1s" in error["message"]
        # That request's demand wakes the pool at the next poll all the same.
        polling.on.set()
        wait_for("woken again", lambda: len(ours()) == 2, timeout=120)
        assert reason_starts("up 0->1: ")()
    history = rig.history()
    assert history.count("autoscale up 0->1") == 2 and history.count("autoscale down 1->0") == 1


def hpcserve(*argv: str) -> str:
    """An admin's `hpcserve` command, as its own process; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", *argv],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_admins_scale_override_wins_over_the_autoscaler_until_reset(rig: PoolRig) -> None:
    """`hpcserve scale p 3` on an idle autoscaled pool (min 1): it goes to 3 and stays
    there, though the autoscaler would take an idle pool down within 4 s; `hpcserve scale p
    --reset` gives it back, and the autoscaler drains it to its floor step by step."""
    config = rig.config("ov", POOL)
    path = rig.state_dir / "hpcserve.toml"
    path.write_text(dump_config(config))
    registry = CollectorRegistry()
    manager = PoolManager(config, rig.slurm, metrics_registry=registry)

    def ours() -> list[SlurmJob]:
        return [j for j in rig.slurm.jobs(name_prefix="ov-").jobs if j.name == "ov-p"]

    def serving() -> int:
        return len(rig.serving("p"))

    def auto() -> Any:
        status = read_status(rig.state_dir)
        return status.pools[0].autoscale if status is not None else None

    def decisions(direction: str) -> float:
        sample = registry.get_sample_value(
            "hpcserve_poolmgr_autoscale_decisions_total", {"pool": "p", "direction": direction}
        )
        return sample or 0.0

    with Polling(manager):
        wait_for("one serving replica", lambda: serving() == 1)
        assert hpcserve("scale", "p", "3", "--config", str(path)).startswith(
            "pool p: desired replicas 3; autoscaling paused until --reset"
        )
        wait_for("three serving replicas", lambda: serving() == 3)
        # Idle all along: with no override the pool would have gone down 2 s into its slack
        # (scale_down_window_s), and again 2 s later (the cooldown). Waited past that:
        window = 2 + 2  # POOL's scale_down_window_s + scale_down_cooldown_s
        wait_for("the pool idle past its scale-down window and cooldown, twice",
                 lambda: (s := manager.autoscaled.signals.get("p")) is not None
                 and s.idle_s is not None and s.idle_s > 3 * window)  # fmt: skip
        assert (auto().target, len([j for j in ours() if j.state.is_active])) == (3, 3)
        assert (decisions("override"), decisions("down")) == (1, 0)
        pinned = hpcserve("status", "--config", str(path))
        assert "1..3, target 3" in pinned, pinned
        assert "last change: override 1->3: admin's `hpcserve scale`; autoscaling resumes " \
            "after `hpcserve scale --reset`" in pinned, pinned  # fmt: skip
        # Reset: the autoscaler takes the pool back from 3, and drains it to its floor.
        assert hpcserve("scale", "p", "--reset", "--config", str(path)).startswith(
            "pool p: autoscaling resumes"
        )
        wait_for("back to one job", lambda: len([j for j in ours() if j.state.is_active]) == 1)
        wait_for("the status at 1", lambda: auto().target == 1)
    assert [j.state for j in ours() if not j.state.is_active] == [JobState.COMPLETED] * 2
    assert (decisions("override"), decisions("down")) == (2, 2)
    back = hpcserve("status", "--config", str(path))
    assert "1..3, target 1" in back and "last change: down 2->1: " in back, back
    history = [
        m for r in rig.caplog.records if (m := r.getMessage()).startswith("pool p: autoscale ")
    ]
    changes = [line.removeprefix("pool p: autoscale ").split(":")[0] for line in history]
    assert changes == ["override 1->3", "override 3->3", "down 3->2", "down 2->1"], history
    assert "override reset: autoscaling resumes at 3" in history[1], history


def test_an_alias_or_lora_adapter_of_a_pool_at_zero_wakes_it(
    cluster: LocalSlurm, slurm: SlurmCLI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Pools p (docs@1) and q (base@1) at zero, in the model registry with the alias
    extraction -> docs@1 and the LoRA adapter base-lora bound to base@1. A request for the
    alias wakes p and is held until p's replica serves it; one for the adapter wakes q (whose
    simulated engine has no LoRA, so that request runs out of its 3 s hold: 503)."""
    caplog.set_level(logging.INFO, "hpcserve.poolmgr")
    with ModelRegistry(tmp_path / "registry.sqlite3") as reg:
        for name in ("docs", "base", "lora"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "weights.bin").write_bytes(name.encode() * 1000)
        reg.add_version("docs", str(tmp_path / "docs"), build_manifest(tmp_path / "docs"))
        reg.add_version("base", str(tmp_path / "base"), build_manifest(tmp_path / "base"))
        reg.set_alias("extraction", "docs@1")
        lora = tmp_path / "lora"
        reg.add_adapter("base-lora", "base@1", str(lora), build_manifest(lora), rank=8)
    catalogs = str(tmp_path / "registry.sqlite3")
    asleep = {**ZERO_POOL, "autoscale": {**ZERO_POOL["autoscale"], "idle_s": 600}}
    with running_router(
        loopback_router_config(),
        aliases=AliasRouter(AliasCatalog.from_registry(catalogs)),
        adapters=AdapterRouter(AdapterCatalog.from_registry(catalogs)),
    ) as router:
        config = cluster_config(
            cluster, router, tmp_path, "wk", {**asleep, "model_path": "", "model_ref": "docs@1"},
            engine={"cache_dir": str(tmp_path / "cache" / "{node}")},
        )  # fmt: skip
        keys = [ApiKey(tenant="t", sha256=hash_api_key(KEY))]
        gateway = msgspec.structs.replace(config.gateway, api_keys=keys, port=free_port())
        config = msgspec.structs.replace(config, gateway=gateway)
        short = {"autoscale": {**asleep["autoscale"], "wake_budget_s": 3}}
        q = msgspec.convert(
            {**asleep, **short, "name": "q", "model_path": "", "model_ref": "base@1"}, PoolConfig
        )
        config = msgspec.structs.replace(config, pools=[*config.pools, q])
        (tmp_path / "gw.toml").write_text(dump_config(config))
        manager = PoolManager(config, slurm, metrics_registry=CollectorRegistry())

        def reason(pool: str) -> str:
            status = read_status(tmp_path)
            auto = {s.pool: s.autoscale for s in status.pools} if status else {}
            return auto[pool].last_reason if auto.get(pool) else ""

        def serving(pool: str) -> int:
            return sum(1 for r in list_replicas(router.config.routing_bind) if r.pool == pool)

        url = f"http://127.0.0.1:{config.gateway.port}"
        with service(gateway_argv(tmp_path / "gw.toml"), url), Polling(manager):
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
            wait_for("the pool manager's first status", lambda: read_status(tmp_path))
            assert (serving("p"), serving("q")) == (0, 0)
            reply = client.chat.completions.create(
                model="extraction", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert reply.choices[0].finish_reason == "length"
            assert reason("p").startswith("up 0->1: a request found no replica"), reason("p")
            assert serving("q") == 0 and reason("q") == ""  # the alias woke only its pool
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="base-lora", prompt="x", max_tokens=4)
            assert refused.value.status_code == 503 and "model_starting" in str(refused.value)
            wait_for("q woken by its adapter", lambda: serving("q") == 1)
            assert reason("q").startswith("up 0->1: a request found no replica"), reason("q")
