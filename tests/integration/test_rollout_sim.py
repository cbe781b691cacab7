"""Staged rollouts end to end with simulated engines: docs@1 and docs@2 of one registry model
served by two sim engines, the real router reading the alias from the real registry, a real
gateway process counting per version, and a real pool manager process (`hpcserve poolmgr`)
whose rollout loop reads that gateway's /metrics and moves the alias; `hpcserve rollout`
starts it. Steps are seconds long here (--every 2s)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from hpcserve.config import dump_config, hash_api_key, load_config, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.modelcache.evaluations import Evaluation
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr import rollout as ro
from hpcserve.poolmgr.rollout_state import RolloutBook
from hpcserve.router.aliases import AliasCatalog, AliasRouter
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import alias_registry, loopback_router_config, running_router
from tests.services import gateways, metrics_headers, service, sim_engine_argv, stop

ALIAS = "extraction"
KEY = "sk-rollout-test"
ROLLOUT_S = 180  # generous: a loaded 2-core machine


@dataclass
class Deployment:
    root: Path
    registry: Path
    gateway: str
    gateway_config: Path
    poolmgr_config: Path
    answered: Counter[str] = field(default_factory=Counter)
    logs: list[Path] = field(default_factory=list)

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hpcserve.cli", "rollout", *argv,
             "--config", str(self.poolmgr_config)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    def rollout(self) -> ro.Rollout | None:
        return RolloutBook(self.root / "state").read().get(ALIAS)

    def alias(self) -> tuple[str, str | None, int]:
        with Registry(self.registry) as reg:
            a = reg.alias(ALIAS)
        return a.target, a.canary, a.canary_percent

    @contextmanager
    def poolmgr(self) -> Iterator[subprocess.Popen[bytes]]:
        log = self.root / f"poolmgr{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hpcserve.cli", "poolmgr", "--config",
                 str(self.poolmgr_config)],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            yield proc
        finally:
            stop(proc)

    def gateway_metrics(self) -> str:
        headers = metrics_headers(self.gateway_config)
        return httpx.get(self.gateway + "/metrics", headers=headers, timeout=10).text


@contextmanager
def traffic(d: Deployment) -> Iterator[None]:
    """Requests for the alias, one after another, without a user: each draws its version."""
    done = threading.Event()
    client = openai.OpenAI(base_url=d.gateway + "/v1", api_key=KEY, max_retries=0)

    def run() -> None:
        while not done.is_set():
            try:
                reply = client.chat.completions.create(
                    model=ALIAS,
                    messages=[{"role": "user", "content": "the bill of lading number"}],
                    max_tokens=4,
                )
                d.answered[reply.model] += 1
            except openai.APIStatusError as err:
                d.answered[f"error {err.status_code}"] += 1
            except openai.APIError:
                d.answered["no answer"] += 1

    thread = threading.Thread(target=run, name="traffic", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(30)


@contextmanager
def deployment(root: Path, *, v2_args: tuple[str, ...] = ()) -> Iterator[Deployment]:
    registry = alias_registry(root)
    with Registry(registry) as reg:  # docs@2 passed its parity gate
        reg.record_evaluation(
            Evaluation(
                ref="docs@2", suite="bol", suite_digest="0" * 64, suite_path="bol.jsonl",
                cases=1, scores={"exact": 100.0}, key_metrics=["exact"], passed=True,
            )
        )  # fmt: skip
    ports = {"docs-v1": free_port(), "docs-v2": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    aliases = AliasRouter(AliasCatalog.from_registry(str(registry), refresh_s=0.2))
    router_config = loopback_router_config(lease_s=600.0)
    gateway = {"api_keys": [{"tenant": "team", "sha256": hash_api_key(KEY)}]}
    (root / "gw").mkdir()
    with (
        service(sim_engine_argv(ports["docs-v1"], "docs-v1", 0.1), urls["docs-v1"]),
        service(sim_engine_argv(ports["docs-v2"], "docs-v2", 0.1, *v2_args), urls["docs-v2"]),
        running_router(router_config, aliases=aliases) as router,
        gateways(router_config, gateway, root / "gw", count=1, model="docs-v1") as gw_urls,
    ):
        for name, ref in (("docs-v1", "docs@1"), ("docs-v2", "docs@2")):
            spec = p.Register(name, name, urls[name], pool=name, model_ref=ref)
            router.registry.register(spec, now=1e12)
        gateway_config = root / "gw" / "gateway0.toml"
        config = parse_config({
            "state_dir": str(root / "state"),
            "registry": str(registry),
            "router": {"registry_bind": router_config.registry_bind,
                       "routing_bind": router_config.routing_bind,
                       "lease_s": router_config.lease_s,
                       "heartbeat_s": router_config.heartbeat_s},
            "gateway": {"metrics_token_file": load_config(gateway_config).metrics_token_path()},
            "poolmgr": {"launcher": "local", "poll_s": 1.0, "metrics_port": 0},
            "rollout": {"gateways": gw_urls, "check_s": 0.3, "min_answers": 10},
        })  # fmt: skip
        poolmgr_config = root / "poolmgr.toml"
        poolmgr_config.write_text(dump_config(config))
        yield Deployment(root, registry, gw_urls[0], gateway_config, poolmgr_config)


def test_a_rollout_completes_to_100_percent(tmp_path: Path) -> None:
    with deployment(tmp_path) as d, d.poolmgr(), traffic(d):
        started = d.cli("start", ALIAS, "docs@2", "--steps", "20,50,100", "--every", "2s")
        assert started.returncode == 0, started.stderr
        wait_for(
            "the canary to take its first share",
            lambda: d.alias() == ("docs@1", "docs@2", 20),
            ROLLOUT_S,
        )
        wait_for(
            "the rollout to complete",
            lambda: (r := d.rollout()) is not None and not r.active,
            ROLLOUT_S,
        )
        r = d.rollout()
        assert r is not None and r.state == ro.COMPLETED, r
        assert d.alias() == ("docs@2", None, 0)
        # Everyone on the new version now (the router re-reads the alias within 0.2 s).
        wait_for("the next 20 answers all from docs-v2", lambda: _only_v2_next(d), ROLLOUT_S)
        metrics = d.gateway_metrics()
    # The gateway counted both versions' answers to the alias under their version labels;
    # every answer of 4 tokens was cut at max_tokens (finish_reason "length").
    for version in ("docs@1", "docs@2"):
        labels = f'{{adapter="",model="{ALIAS}",version="{version}"}}'
        assert f"hpcserve_gateway_deployment_answers_total{labels}" in metrics
        assert f"hpcserve_gateway_deployment_truncations_total{labels}" in metrics
    lines = d.logs[0].read_text()
    assert "step 1 of 3 at 20% (started)" in lines
    assert "step 2 of 3 at 50%" in lines
    assert "completed: docs@2 is the target" in lines


def _only_v2_next(d: Deployment) -> bool:
    d.answered.clear()
    wait_for("20 more answers", lambda: sum(d.answered.values()) >= 20, ROLLOUT_S)
    return set(d.answered) == {"docs-v2"}


def test_an_injected_error_rate_rolls_back_at_once(tmp_path: Path) -> None:
    with (
        deployment(tmp_path, v2_args=("--sim-error-rate", "0.5")) as d,
        d.poolmgr(),
        traffic(d),
    ):
        started = d.cli("start", ALIAS, "docs@2", "--steps", "25,100", "--every", "10m")
        assert started.returncode == 0, started.stderr
        wait_for(
            "the rollout to roll back",
            lambda: (r := d.rollout()) is not None and r.state == ro.ROLLED_BACK,
            ROLLOUT_S,
        )
        r = d.rollout()
        assert r is not None and r.reason.startswith("error rate"), r.reason
        assert d.alias() == ("docs@1", None, 0)  # long before the 10 minutes of the step
        status = d.cli("status", ALIAS)
        assert "rolled_back at 0%: error rate" in status.stdout, status.stdout
        metrics = d.gateway_metrics()
    assert d.answered["error 500"] > 0  # the clients saw the injected failures
    labels = f'{{adapter="",model="{ALIAS}",version="docs@2"}}'
    assert f"hpcserve_gateway_deployment_errors_total{labels}" in metrics
    assert "rolled back at 25%: error rate" in d.logs[0].read_text()


def test_a_rollout_survives_a_pool_manager_restart(tmp_path: Path) -> None:
    with deployment(tmp_path) as d, traffic(d):
        started = d.cli("start", ALIAS, "docs@2", "--steps", "20,50,100", "--every", "3s")
        assert started.returncode == 0, started.stderr
        with d.poolmgr():
            wait_for(
                "the second step",
                lambda: (r := d.rollout()) is not None and r.step == 1,
                ROLLOUT_S,
            )
        stopped = d.rollout()
        assert stopped is not None and (stopped.state, stopped.share) == (ro.HOLDING, 50)
        assert d.alias() == ("docs@1", "docs@2", 50)  # the share stays while it is down
        with d.poolmgr():
            wait_for(
                "the rollout to complete",
                lambda: (r := d.rollout()) is not None and not r.active,
                ROLLOUT_S,
            )
    r = d.rollout()
    assert r is not None and r.state == ro.COMPLETED
    assert d.alias() == ("docs@2", None, 0)
    second = d.logs[1].read_text()
    # The second pool manager went on from step 2: it neither started over nor re-entered it.
    assert "completed: docs@2 is the target" in second
    assert "step 1 of 3" not in second and "step 2 of 3" not in second
