"""The health monitor that runs beside one engine, inside its Slurm job.

Two threads feed one queue of reports that the engine's serve loop reads (it owns the
router socket): an Xid watcher blocked in NVML's event wait (a new Xid is reported within
its 0.5 s wait), and a check round every `probe_interval_s`: the GPU state checks, the
one-token generation probe, the token-progress check and, where the version has a golden
record, the numerical canary (health/canary.py). `ReplicaHealth` (pure) turns the
reports into what the engine does: tell the router, leave routing, drain, rejoin, give up.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pynvml

from hpcserve.config import HealthConfig
from hpcserve.contracts.health_policy import severity, worst_action
from hpcserve.contracts.protocol import HealthFinding
from hpcserve.health.canary import CanaryOutcome, CanaryWatch
from hpcserve.health.engine_checks import (
    GenerationProbe,
    TokenProgress,
    busy_not_broken,
    parse_counters,
)
from hpcserve.health.gpu_checks import GpuChecks, XidWatcher, parse_visible_devices, select_gpus
from hpcserve.health.nvml import NvmlUnavailable, fake_state_path, open_nvml
from hpcserve.health.policy import Policy

log = logging.getLogger(__name__)

HEALTH_ENV = "HPCSERVE_HEALTH"  # the job's HealthConfig as JSON (set by the pool manager)


@dataclass(frozen=True)
class Report:
    findings: list[HealthFinding]
    # A full check round (GPU state and engine): when clean, a replica out of routing for an
    # engine finding may rejoin. Xid events are not rounds.
    round: bool = False
    # A numerical canary ran in this round (health/canary.py): its outcome, for the router.
    canary: CanaryOutcome | None = None


@dataclass(frozen=True)
class Decision:
    report: list[HealthFinding] = field(default_factory=list)  # new: tell the router, log
    leave: bool = False  # stop routing to the replica
    drain: bool = False  # leave, drain in-flight requests and stop (the node is condemned)
    rejoin: bool = False
    give_up: str = ""  # stop the engine hard: it stayed broken too long


class ReplicaHealth:
    """What a replica does about its health reports (pure; the caller passes the clock)."""

    def __init__(self, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        self.in_service = True
        self.draining = False
        self.out_since: float | None = None
        self._active: set[str] = set()

    def update(self, report: Report, now: float) -> Decision:
        details = {f.detail for f in report.findings}
        new = [f for f in report.findings if f.detail not in self._active]
        self._active = details if report.round else self._active | details
        worst = worst_action(report.findings)
        if self.draining:
            return Decision(report=new)
        if severity(worst) >= severity("drain"):
            self.draining, self.in_service = True, False
            return Decision(report=new, leave=True, drain=True)
        if worst == "stop_routing" and self.in_service:
            self.in_service, self.out_since = False, now
            return Decision(report=new, leave=True)
        if not self.in_service and report.round and worst != "stop_routing":
            self.in_service, self.out_since = True, None
            return Decision(report=new, rejoin=True)
        out_s = now - self.out_since if self.out_since is not None else 0.0
        if not self.in_service and out_s >= self.give_up_s:
            return Decision(
                report=new,
                give_up=f"out of routing for {out_s:.0f}s (health.give_up_s "
                f"{self.give_up_s:g}): " + "; ".join(sorted(details)),
            )
        return Decision(report=new)


def _http_text(url: str, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace") if resp.status == 200 else None
    except OSError:
        return None


class HealthMonitor:
    def __init__(
        self,
        config: HealthConfig,
        *,
        engine_url: str,
        model: str,
        nvml: Any = None,
        visible: list[str] | None = None,
        expected_gpus: int = 0,
        engine_token: str = "",
        canary_record: str = "",
        model_ref: str = "",
    ) -> None:
        self.config = config
        self.policy = Policy(config)
        # The periodic numerical canary, where the job names a golden record's file.
        self.canary: CanaryWatch | None = None
        if canary_record and engine_url and config.canary_interval_s > 0:
            self.canary = CanaryWatch(
                canary_record,
                engine_url=engine_url,
                model=model,
                model_ref=model_ref,
                policy=self.policy,
                interval_s=config.canary_interval_s,
                deadline_s=config.canary_deadline_s,
                engine_token=engine_token,
            )
        self.engine_url = engine_url.rstrip("/")
        self.probe = GenerationProbe(engine_url, model, engine_token=engine_token)
        self.progress = TokenProgress(config.stall_s)
        self.nvml = nvml
        self.gpu_checks = (
            GpuChecks(nvml, self.policy, expected=expected_gpus, visible=visible)
            if nvml is not None
            else None
        )
        self.xids: XidWatcher | None = None
        if nvml is not None:
            try:
                self.xids = XidWatcher(nvml, self.policy, select_gpus(nvml, visible))
            except pynvml.NVMLError as err:  # the check rounds report NVML's state
                log.error("health: cannot watch Xid events: %s", err)
        self._queue: queue.Queue[Report] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unprobeable_logged = False
        self._busy = False  # the last probe timed out behind a queue of a working engine

    def start(self) -> None:
        targets = [("health-checks", self._check_loop)]
        if self.xids is not None and self.xids.watched:
            targets.append(("health-xids", self._xid_loop))
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "health monitor started: %s, generation probe every %gs (deadline %gs)",
            f"GPUs {self.xids.watched} through NVML" if self.xids else "no GPU checks",
            self.config.probe_interval_s,
            self.config.probe_deadline_s,
        )

    def stop(self) -> None:
        """Stop the threads; a probe in flight is not waited for (the threads are daemons)."""
        self._stop.set()
        xid_threads = [t for t in self._threads if t.name == "health-xids"]
        for thread in xid_threads:
            thread.join(2.0)
        if self.xids is not None and not any(t.is_alive() for t in xid_threads):
            self.xids.close()

    def reports(self) -> list[Report]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def check_round(self) -> Report:
        findings = list(self.gpu_checks.run()) if self.gpu_checks is not None else []
        if not self.engine_url:  # a node rank > 0: its GPUs only, rank 0 probes the engine
            return Report(findings, round=True)
        metrics_deadline_s = min(self.config.probe_deadline_s, 5)
        text = _http_text(self.engine_url + "/metrics", metrics_deadline_s)
        before = parse_counters(text) if text is not None else None
        result = self.probe.run(self.config.probe_deadline_s)
        text = _http_text(self.engine_url + "/metrics", metrics_deadline_s)
        after = parse_counters(text) if text is not None else None
        busy = result.timed_out and busy_not_broken(before, after)
        if busy != self._busy:
            self._busy = busy
            if busy:
                assert after is not None
                log.warning(
                    "health: engine probe: %s behind %d waiting while tokens flow: "
                    "busy, not broken (stays in routing)",
                    result.detail,
                    after.waiting,
                )
            else:
                log.info("health: engine probe answers again within its deadline")
        if not result.ok:
            if not busy:  # busy: the token-progress check below still catches a hang
                finding = self.policy.finding("engine_probe", f"engine probe: {result.detail}")
                findings.append(finding)
        elif result.detail and not self._unprobeable_logged:
            log.warning("health: %s; relying on the token counters", result.detail)
            self._unprobeable_logged = True
        if after is not None:
            stalled = self.progress.update(after, time.monotonic())
            if stalled:
                findings.append(self.policy.finding("engine_stall", f"engine stalled: {stalled}"))
        outcome = None
        if self.canary is not None:
            canary_findings, outcome = self.canary.round()
            findings += canary_findings
        return Report(findings, round=True, canary=outcome)

    def _check_loop(self) -> None:
        while not self._stop.wait(self.config.probe_interval_s):
            try:
                self._queue.put(self.check_round())
            except Exception:  # a bug in a check must not stop the monitor silently
                log.exception("health check round failed")

    def _xid_loop(self) -> None:
        assert self.xids is not None
        while not self._stop.is_set():
            try:
                findings = self.xids.wait(0.5)
            except Exception:  # keep watching; a bug must not end the watch silently
                log.exception("health: Xid event wait failed")
                self._stop.wait(1.0)
                continue
            if findings:
                self._queue.put(Report(findings))


def health_config_from_env(env: Mapping[str, str]) -> HealthConfig:
    raw = env.get(HEALTH_ENV, "")
    if not raw:
        return HealthConfig()
    try:
        return msgspec.json.decode(raw.encode(), type=HealthConfig)
    except msgspec.ValidationError as err:
        raise ValueError(f"${HEALTH_ENV}: {err}") from None


def monitor_for_engine(
    *,
    engine: str,
    engine_url: str,
    model: str,
    node: str,
    env: Mapping[str, str] | None = None,
    engine_token: str = "",
    canary_record: str = "",
    model_ref: str = "",
) -> HealthMonitor | None:
    """The monitor for one engine as its job's environment configures it; None when off."""
    env = os.environ if env is None else env
    config = health_config_from_env(env)
    if not config.monitor:
        return None
    fake = fake_state_path(config.fake_nvml, env, node)
    wants_nvml = config.gpu_checks == "nvml" or (
        config.gpu_checks == "auto" and (engine == "vllm" or bool(fake))
    )
    nvml = None
    if wants_nvml:
        try:
            nvml = open_nvml(fake)
        except NvmlUnavailable as err:
            log.warning("health monitor runs without GPU checks: %s", err)
    expected = env.get("SLURM_GPUS_ON_NODE", "")
    return HealthMonitor(
        config,
        engine_url=engine_url,
        model=model,
        nvml=nvml,
        visible=parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES")),
        expected_gpus=int(expected) if expected.isdigit() else 0,
        engine_token=engine_token,
        canary_record=canary_record,
        model_ref=model_ref,
    )
