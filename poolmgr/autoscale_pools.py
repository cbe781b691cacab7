"""Autoscaled interactive pools in the pool manager: each poll, the size of every pool with
`autoscale`, from its replicas' load as the router lists it (poolmgr/autoscale.py decides).

This module gathers the decision's inputs (the router's replica list of the poll, the jobs
Slurm shows, `hpcserve scale` overrides), keeps each pool's state between polls, logs one
line and counts one decision per change of a pool's target, and keeps what `hpcserve
status` shows (target, signals, the last change's reason). A scale-down is a smaller
desired size: reconcile drains the surplus replica (USR1: it leaves routing, finishes what
it has in flight and ends), so no request fails.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from hpcserve.config import PlatformConfig
from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.poolmgr.autoscale import (
    AutoscaleState,
    Decision,
    ReplicaSignal,
    Signals,
    decide,
    initial_state,
)
from hpcserve.poolmgr.reconcile import ObservedJob

log = logging.getLogger(__name__)


class AutoscaleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.target = Gauge(
            "hpcserve_poolmgr_autoscale_target",
            "An autoscaled pool's target replicas",
            ["pool"],
            registry=registry,
        )
        self.decisions = Counter(
            "hpcserve_poolmgr_autoscale_decisions_total",
            "Changes of an autoscaled pool's target, by direction (up, down, override)",
            ["pool", "direction"],
            registry=registry,
        )


class AutoscaledPools:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.metrics = AutoscaleMetrics(registry)
        self.states: dict[str, AutoscaleState] = {}
        self.decisions: dict[str, Decision] = {}  # pool -> this poll's decision
        self.signals: dict[str, Signals] = {}  # pool -> this poll's signals

    def resize(
        self,
        config: PlatformConfig,
        desired: Mapping[str, int],
        overrides: Mapping[str, int],
        jobs: Sequence[ObservedJob],
        draining: Mapping[int, float],
        replicas: Sequence[ReplicaInfo] | None,
        admin_serving: Mapping[str, int],
        now: float,
    ) -> dict[str, int]:
        """`desired` with each autoscaled pool's target in place of its fixed size.
        replicas: the router's list of this poll; None when the router did not answer (every
        pool then holds its target: no decision on stale load)."""
        out = dict(desired)
        scaled = {pool.name: pool for pool in config.pools if pool.autoscale is not None}
        for name in set(self.states) - set(scaled):  # autoscale removed by a reload
            del self.states[name]
            self.decisions.pop(name, None)
            self.signals.pop(name, None)
            self.metrics.target.remove(name)
        for name, pool in scaled.items():
            auto = pool.autoscale
            assert auto is not None
            live = [j for j in jobs if j.pool == name and j.job_id not in draining]
            serving = [
                r for r in replicas or [] if r.pool == name and r.slurm_job_id not in draining
            ]
            state = self.states.get(name) or initial_state(
                auto, pool.replicas, len(live) + admin_serving.get(name, 0)
            )
            signals = Signals(
                replicas=[
                    ReplicaSignal(r.in_flight, r.load.running, r.load.waiting, r.load.kv_usage)
                    for r in serving
                ],
                starting=sum(1 for j in live if not j.serving),
                override=overrides.get(name),
                measured=replicas is not None,
            )
            decision = decide(auto, signals, state, now)
            if decision.changed:
                log.info("pool %s: autoscale %s (%s)", name, decision.reason, signals.summary())
                self.metrics.decisions.labels(name, decision.direction).inc()
            self.states[name] = decision.state
            self.decisions[name] = decision
            self.signals[name] = signals
            self.metrics.target.labels(name).set(decision.target)
            out[name] = decision.target
        return out
