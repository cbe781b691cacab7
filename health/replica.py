"""The engine's side of health: runs the monitor and acts on its reports in the engine's
serve loop, which owns the router socket.

- a new finding is sent to the router (HealthReport) and logged, one line each; each
  numerical canary the monitor ran is counted there (CanaryReport);
- stop_routing: the router drops the replica at once; the engine stops heartbeating but
  keeps serving what it has, keeps checking, and registers again after a clean round;
  out of routing longer than health.give_up_s, it gives up (the job fails and is replaced);
- drain or drain_reset: the replica leaves routing and drains (in-flight requests finish),
  the job ends, and the pool manager drains the node in Slurm and replaces the capacity.

On node ranks > 0 of a multi-node replica (WorkerHealth) only the node's GPUs are checked:
a finding of stop_routing or worse is reported (the pool manager drains that node) and
the rank stops its workers, which fails the replica through rank 0 (engine_launch/lifeline.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from hpcserve.contracts import protocol as p
from hpcserve.contracts.health_policy import drain_reason, severity, worst_action
from hpcserve.health.monitor import HealthMonitor, ReplicaHealth, monitor_for_engine

log = logging.getLogger(__name__)


class Agent(Protocol):
    registered: bool

    def register(self) -> None: ...

    def send(self, message: p.RegistryMessage) -> None: ...

    def close(self) -> None: ...


class EngineHealth:
    def __init__(
        self,
        monitor: HealthMonitor,
        agent: Agent,
        registration: p.Register,
        *,
        on_drain: Callable[[str], None],
        on_give_up: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.monitor = monitor
        self.agent = agent
        self.registration = registration
        self.state = ReplicaHealth(monitor.config.give_up_s)
        self._on_drain = on_drain
        self._on_give_up = on_give_up
        self._clock = clock

    @classmethod
    def start(
        cls,
        agent: Agent,
        registration: p.Register,
        *,
        engine: str,
        engine_url: str,
        on_drain: Callable[[str], None],
        on_give_up: Callable[[str], None],
        engine_token: str = "",
        canary_record: str = "",
    ) -> EngineHealth | None:
        monitor = monitor_for_engine(
            engine=engine,
            engine_url=engine_url,
            model=registration.model,
            node=registration.node,
            engine_token=engine_token,
            canary_record=canary_record,
            model_ref=registration.model_ref,
        )
        if monitor is None:
            log.info("health monitor off (health.monitor = false)")
            return None
        monitor.start()
        return cls(monitor, agent, registration, on_drain=on_drain, on_give_up=on_give_up)

    @property
    def in_service(self) -> bool:
        return self.state.in_service

    def step(self) -> None:
        reg = self.registration
        for report in self.monitor.reports():
            if report.canary is not None:
                self.agent.send(
                    p.CanaryReport(
                        replica_id=reg.replica_id,
                        model_ref=reg.model_ref,
                        result=report.canary.result,
                        stage="periodic",
                        detail=report.canary.detail,
                    )
                )
            decision = self.state.update(report, self._clock())
            for finding in decision.report:
                log.warning(
                    "health: %s (check %s, action %s)",
                    finding.detail,
                    finding.check,
                    finding.action,
                )
            if decision.report:
                self.agent.send(
                    p.HealthReport(
                        replica_id=reg.replica_id,
                        findings=decision.report,
                        node=reg.node,
                        slurm_job_id=reg.slurm_job_id,
                        pool=reg.pool,
                    )
                )
            if decision.leave:
                self.agent.registered = False
            if decision.drain:
                reason = drain_reason(report.findings)
                log.warning("replica %s leaves routing and drains: %s", reg.replica_id, reason)
                self._on_drain(f"health: {reason}")
            elif decision.leave:
                log.warning("replica %s leaves routing until its checks pass", reg.replica_id)
            if decision.rejoin:
                log.info("replica %s passes its checks again: rejoining", reg.replica_id)
                self.agent.register()
            if decision.give_up:
                log.error("replica %s gives up: %s", reg.replica_id, decision.give_up)
                self._on_give_up(decision.give_up)

    def stop(self) -> None:
        self.monitor.stop()


class WorkerHealth:
    """GPU checks of a node rank > 0; its findings go to the router under the rank's own id."""

    def __init__(self, monitor: HealthMonitor, agent: Agent, registration: p.Register) -> None:
        self.monitor = monitor
        self.agent = agent
        self.registration = registration

    @classmethod
    def start(cls, agent: Agent, registration: p.Register) -> WorkerHealth | None:
        monitor = monitor_for_engine(
            engine="vllm", engine_url="", model=registration.model, node=registration.node
        )
        if monitor is None:
            return None
        monitor.start()
        return cls(monitor, agent, registration)

    def step(self) -> str:
        """The reason this rank must stop its workers, or "" while its GPUs are sound."""
        reg = self.registration
        for report in self.monitor.reports():
            if not report.findings:
                continue
            for finding in report.findings:
                log.warning(
                    "health: %s (check %s, action %s)",
                    finding.detail,
                    finding.check,
                    finding.action,
                )
            if severity(worst_action(report.findings)) < severity("stop_routing"):
                continue
            self.agent.send(
                p.HealthReport(
                    replica_id=reg.replica_id,
                    findings=list(report.findings),
                    node=reg.node,
                    slurm_job_id=reg.slurm_job_id,
                    pool=reg.pool,
                )
            )
            return drain_reason(report.findings)
        return ""

    def stop(self) -> None:
        self.monitor.stop()
        self.agent.close()  # lingers long enough to deliver a report just sent
