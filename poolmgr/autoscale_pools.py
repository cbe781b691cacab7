"""Autoscaled interactive pools in the pool manager: each poll, the size of every pool with
`autoscale`, from its replicas' load as the router lists it (poolmgr/autoscale.py decides).

This module gathers the decision's inputs (the router's replica list of the poll, the jobs
Slurm shows, `hpcserve scale` overrides), keeps each pool's state between polls, logs one
line and counts one decision per change of a pool's target, and keeps what `hpcserve
status` shows (target, signals, the last change's reason). A scale-down is a smaller
desired size: reconcile drains the surplus replica (USR1: it leaves routing, finishes what
it has in flight and ends), so no request fails.

Scale to zero (autoscale.min = 0) needs to know when a request last came for a pool, which
the poll's snapshot of in-flight counts misses for requests shorter than a poll: each
replica's `routed` count (requests the router routed to it) is compared with the last poll's,
and the router's unserved demand (a Route for the model that found no replica, which the
gateway repeats while it holds a request for a pool at zero) counts as a request too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from hpcserve.config import AutoscaleConfig, PlatformConfig
from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.poolmgr.autoscale import (
    AutoscaleState,
    Decision,
    ReplicaSignal,
    Signals,
    decide,
    initial_state,
)
from hpcserve.poolmgr.autoscale_capacity import Capacities
from hpcserve.poolmgr.autoscale_roles import watches
from hpcserve.poolmgr.autoscale_schedule import scheduled_floor
from hpcserve.poolmgr.batch_limit import BatchLimits
from hpcserve.poolmgr.batch_pools import is_elastic
from hpcserve.poolmgr.forecast import Forecasts
from hpcserve.poolmgr.gpu_take import WAITING_FOR_GPUS, Donor, Shape, Waiting, choose
from hpcserve.poolmgr.reconcile import ObservedJob
from hpcserve.poolmgr.request_time import RequestTimes
from hpcserve.poolmgr.slo_windows import Kind, SloWindows
from hpcserve.poolmgr.spec import job_partition

log = logging.getLogger(__name__)


class AutoscaleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.target = Gauge(
            "hpcserve_poolmgr_autoscale_target",
            "An autoscaled pool's target replicas",
            ["pool"],
            registry=registry,
        )
        self.slo_p95 = Gauge(
            "hpcserve_poolmgr_autoscale_slo_p95_seconds",
            "An autoscaled pool's TTFT/TPOT p95 (slo ttft, tpot) over its short and long "
            "window (from the engines' histograms; absent: too few requests)",
            ["pool", "slo", "window"],
            registry=registry,
        )
        self.slo_objective = Gauge(
            "hpcserve_poolmgr_autoscale_slo_objective_seconds",
            "An autoscaled pool's SLO (slo ttft: autoscale.ttft_p95_s, tpot: tpot_p95_s), "
            "for alerts on its p95",
            ["pool", "slo"],
            registry=registry,
        )
        self.rate = Gauge(
            "hpcserve_poolmgr_autoscale_rate_rps",
            "An autoscaled pool's arrivals (requests/s; kind now: the smoothed level, "
            "forecast: one measured cold start ahead)",
            ["pool", "kind"],
            registry=registry,
        )
        self.request_seconds = Gauge(
            "hpcserve_poolmgr_autoscale_request_seconds",
            "A request's time running in one of an autoscaled pool's replicas, as the "
            "forecast's sizing uses it (source measured: on its engines over the last hour, "
            "poolmgr/request_time.py; modelled: the capacity planner's)",
            ["pool", "source"],
            registry=registry,
        )
        self.capacity = Gauge(
            "hpcserve_poolmgr_autoscale_capacity_in_flight",
            "Requests one replica of an autoscaled pool carries within its SLO (source "
            "measured: the batch at which its engines' TPOT p95 reaches the SLO, "
            "poolmgr/batch_limit.py; modelled: the capacity planner's, else the config's "
            "target_in_flight)",
            ["pool", "source"],
            registry=registry,
        )
        self.decisions = Counter(
            "hpcserve_poolmgr_autoscale_decisions_total",
            "Changes of an autoscaled pool's target, by direction (up, down, override)",
            ["pool", "direction"],
            registry=registry,
        )


class AutoscaledPools:
    def __init__(self, registry: CollectorRegistry, state_dir: Path | None = None) -> None:
        """state_dir: where the daily arrival profiles are kept (None: not kept)."""
        self.metrics = AutoscaleMetrics(registry)
        self.forecasts = Forecasts(state_dir)
        # A rehearsal's compressed day (poolmgr/rehearsal_clock.py): each request counts as
        # this many in the forecast; 1: off. The pool manager sets it from its config.
        self.speedup = 1.0
        self.states: dict[str, AutoscaleState] = {}
        self.decisions: dict[str, Decision] = {}  # pool -> this poll's decision
        self.signals: dict[str, Signals] = {}  # pool -> this poll's signals
        self.active_at: dict[str, float] = {}  # pool -> when a request last came for it
        self._routed: dict[str, int] = {}  # replica id -> its routed count at the last poll
        self._first = True  # no routed counts to compare with yet
        self.slo = SloWindows()  # the engines' TTFT/TPOT histograms over time
        self.capacities = Capacities()  # what one replica sustains (autoscale_capacity.py)
        self.request_times = RequestTimes()  # a request's time in a replica, measured
        self._timed: dict[str, bool] = {}  # pool -> its sizing uses the measured time
        self.batch_limits = BatchLimits()  # the batch at the TPOT SLO, measured
        self._limited: dict[str, int] = {}  # pool -> the measured capacity last logged
        # pool -> why it must not grow: a pool of higher priority waits for GPUs (take_gpus)
        self.yield_to: dict[str, str] = {}
        self._take_reason = ""  # why nothing was taken at the last poll (logged on change)

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
        unserved: Mapping[str, float] | None = None,
        lead_s: Mapping[str, float] | None = None,
    ) -> dict[str, int]:
        """`desired` with each autoscaled pool's target in place of its fixed size.
        replicas: the router's list of this poll; None when the router did not answer (every
        pool then holds its target: no decision on stale load). unserved: the router's
        model -> seconds since a Route for it found no replica (ReplicaList.unserved).
        lead_s: pool -> its measured cold start (p90), how far ahead a scheduled floor
        is raised."""
        out = dict(desired)
        unserved = unserved or {}
        local = datetime.fromtimestamp(now)  # schedules are in the host's local time
        routed_before = self._routed
        first = self._first
        if replicas is None:
            self.request_times.gap()
            self.batch_limits.gap()
        else:
            self._first = False
            self._routed = {r.replica_id: r.routed for r in replicas}
            longest = max(
                (p.autoscale.slo_long_window_s for p in config.pools if p.autoscale), default=0.0
            )
            self.slo.observe(replicas, now, longest)
        scaled = {pool.name: pool for pool in config.pools if pool.autoscale is not None}
        for name in set(self.states) - set(scaled):  # autoscale removed by a reload
            del self.states[name]
            self.request_times.forget(name)
            self.batch_limits.forget(name)
            self._timed.pop(name, None)
            self._limited.pop(name, None)
            self.active_at.pop(name, None)
            self.decisions.pop(name, None)
            self.signals.pop(name, None)
            self.metrics.target.remove(name)
            for source in ("measured", "modelled"):
                for gauge in (self.metrics.request_seconds, self.metrics.capacity):
                    with contextlib.suppress(KeyError):
                        gauge.remove(name, source)
            for slo in ("ttft", "tpot"):
                with contextlib.suppress(KeyError):
                    self.metrics.slo_objective.remove(name, slo)
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
            # When a request last came: at start, now (a restart is not an idle pool).
            active_at = self.active_at.get(name, now)
            if any(
                r.in_flight or r.load.running or r.load.waiting
                or r.routed != routed_before.get(r.replica_id, 0)
                for r in serving
            ):  # fmt: skip
                active_at = now
            unserved_age = unserved.get(pool.model)
            if unserved_age is not None:
                active_at = max(active_at, now - unserved_age)
            self.active_at[name] = active_at
            capacity = self.capacities.of(pool)
            signals = Signals(
                replicas=[
                    ReplicaSignal(
                        # A decode replica is in flight from its Route on, while the request
                        # still waits for its prefill: only what its engine holds counts.
                        r.in_flight if watches(pool.role, "in_flight") else 0,
                        r.load.running,
                        r.load.waiting,
                        r.load.kv_usage,
                    )
                    for r in serving
                ],
                starting=sum(1 for j in live if not j.serving),
                override=overrides.get(name),
                measured=replicas is not None,
                idle_s=now - active_at,
                unserved_age_s=unserved_age,
                capacity=capacity.in_flight,
                capacity_rps=capacity.requests_per_s,
                capacity_source=capacity.source,
                yield_to=self.yield_to.get(name, ""),
                role=pool.role,
            )
            ids = [r.replica_id for r in serving]
            signals = replace(
                signals,
                ttft_p95_short=self._p95(auto, ids, "ttft", auto.slo_short_window_s, now),
                ttft_p95_long=self._p95(auto, ids, "ttft", auto.slo_long_window_s, now),
                tpot_p95_short=self._p95(auto, ids, "tpot", auto.slo_short_window_s, now),
                tpot_p95_long=self._p95(auto, ids, "tpot", auto.slo_long_window_s, now),
            )
            if replicas is not None and watches(pool.role, "tpot"):
                # Draining replicas too: what they finish ran at the batch they held.
                self.batch_limits.observe(
                    name, [r for r in replicas if r.pool == name], now, self.speedup
                )
                limit = self.batch_limits.measured(name, auto.tpot_p95_s)
                signals = replace(signals, batch_limit=limit)
                self._log_batch_limit(name, auto, signals)
            if replicas is not None and not first:
                arrivals = sum(max(r.routed - routed_before.get(r.replica_id, 0), 0)
                               for r in serving)  # fmt: skip
                self.forecasts.observe(name, round(arrivals * self.speedup), now, self.speedup)
                if pool.role == "interactive":  # prefill and decode pools: their own model
                    # Draining replicas too: they still run what was routed to them.
                    mine = [r for r in replicas if r.pool == name]
                    self.request_times.observe(
                        name,
                        now,
                        sum(r.load.running for r in mine),
                        sum(max(r.routed - routed_before.get(r.replica_id, 0), 0) for r in mine),
                        self.speedup,
                        sum(r.load.running + r.load.waiting for r in mine),
                    )
                    signals = replace(signals, request_time=self.request_times.measured(name))
                    self._log_request_time(name, signals)
            self._export_request_time(name, signals)
            self._export_capacity(name, auto, signals)
            horizon = (lead_s or {}).get(name, 0.0)
            signals = replace(
                signals,
                rate_rps=self.forecasts.rate(name),
                forecast_rps=self.forecasts.forecast(name, now, horizon),
                forecast_horizon_s=horizon,
            )
            for kind, rate in (("now", signals.rate_rps), ("forecast", signals.forecast_rps)):
                if rate is not None:
                    self.metrics.rate.labels(name, kind).set(rate)
            self._export_slo(name, signals)
            for slo, objective in (("ttft", auto.ttft_p95_s), ("tpot", auto.tpot_p95_s)):
                if signals.watches(slo):  # a prefill pool holds no TPOT, a decode no TTFT
                    self.metrics.slo_objective.labels(name, slo).set(objective)
            if auto.schedule:
                floor, why = scheduled_floor(auto.schedule, local, (lead_s or {}).get(name, 0.0))
                signals = replace(signals, floor=floor, floor_reason=why)
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

    def _log_request_time(self, pool: str, sig: Signals) -> None:
        """One line when the forecast's sizing starts or stops using the measured time."""
        measured = sig.request_time is not None
        if measured == self._timed.get(pool, False):
            return
        self._timed[pool] = measured
        if sig.request_time is not None:
            log.info("pool %s: sizing with a request's measured time in a replica, %s",
                     pool, sig.request_time.describe())  # fmt: skip
        else:
            log.info("pool %s: too few requests in the last hour to measure their time in a "
                     "replica: sizing with the model's again", pool)  # fmt: skip

    def _log_batch_limit(self, pool: str, auto: AutoscaleConfig, sig: Signals) -> None:
        """One line when the sizing starts or stops using the measured batch at the TPOT
        SLO, or that figure moves by a quarter or more since the last line."""
        before = self._limited.get(pool)
        if sig.batch_limit is None:
            if before is not None:
                del self._limited[pool]
                log.info("pool %s: its engines' TPOT no longer gives a batch limit; one "
                         "replica carries the model's or configured %d again", pool,
                         sig.capacity or auto.target_in_flight)  # fmt: skip
            return
        carried = sig.carried(auto.target_in_flight)[0]
        if before is not None and abs(carried - before) < 0.25 * before:
            return
        self._limited[pool] = carried
        log.info("pool %s: one replica carries %d in flight, measured: %s (the model or "
                 "config: %d)", pool, carried, sig.batch_limit.describe(),
                 sig.capacity or auto.target_in_flight)  # fmt: skip

    def _export_capacity(self, pool: str, auto: AutoscaleConfig, sig: Signals) -> None:
        self.metrics.capacity.labels(pool, "modelled").set(sig.capacity or auto.target_in_flight)
        if sig.batch_limit is not None:
            self.metrics.capacity.labels(pool, "measured").set(
                sig.carried(auto.target_in_flight)[0]
            )
        else:
            with contextlib.suppress(KeyError):
                self.metrics.capacity.remove(pool, "measured")

    def _export_request_time(self, pool: str, sig: Signals) -> None:
        for source, seconds in (
            ("measured", sig.request_time.seconds if sig.request_time else None),
            ("modelled", sig.capacity / sig.capacity_rps
                         if sig.capacity and sig.capacity_rps else None),
        ):  # fmt: skip
            if seconds is not None:
                self.metrics.request_seconds.labels(pool, source).set(seconds)

    def _export_slo(self, pool: str, sig: Signals) -> None:
        for slo, window, value in (
            ("ttft", "short", sig.ttft_p95_short),
            ("ttft", "long", sig.ttft_p95_long),
            ("tpot", "short", sig.tpot_p95_short),
            ("tpot", "long", sig.tpot_p95_long),
        ):
            if value is None:
                with contextlib.suppress(KeyError):  # never set
                    self.metrics.slo_p95.remove(pool, slo, window)
            else:
                self.metrics.slo_p95.labels(pool, slo, window).set(value)

    def _p95(
        self, auto: AutoscaleConfig, ids: list[str], kind: Kind, window_s: float, now: float
    ) -> float | None:
        return self.slo.p95(ids, kind, window_s, now, auto.slo_min_requests)

    def take_gpus(
        self,
        config: PlatformConfig,
        desired: Mapping[str, int],
        jobs: Sequence[ObservedJob],
        draining: Mapping[int, float],
        pending_reasons: Mapping[int, str],
        overrides: Mapping[str, int],
        now: float,
    ) -> dict[str, int]:
        """`desired` with a replica taken from a pool of lower priority for an autoscaled
        pool whose job has waited for GPUs past poolmgr.take_gpus_after_s (gpu_take.py).
        pending_reasons: job id -> Slurm's reason, for our pending jobs."""
        out = dict(desired)
        live = [j for j in jobs if j.job_id not in draining]
        waiting: list[Waiting] = []
        donors: list[Donor] = []
        for pool in config.pools:
            mine = [j for j in live if j.pool == pool.name]
            pending = [j for j in mine if j.pending]
            shape = Shape(job_partition(config, pool), pool.gpus_per_replica,
                          pool.nodes_per_replica)  # fmt: skip
            if pool.autoscale is not None and pending:
                oldest = min(pending, key=lambda j: j.submit_time)
                waiting.append(Waiting(
                    pool.name, pool.priority, shape, now - oldest.submit_time, oldest.job_id,
                    pending_reasons.get(oldest.job_id, ""),
                ))  # fmt: skip
            batch = is_elastic(pool)
            if pool.autoscale is None and not batch:
                continue  # a fixed size: never taken
            signals = self.signals.get(pool.name)
            floor = pool.replicas if batch else max(
                pool.autoscale.min if pool.autoscale else 0, signals.floor if signals else 0
            )  # fmt: skip
            # What it keeps running after this poll (a smaller target drains the rest anyway).
            running = min(len(mine) - len(pending), out.get(pool.name, len(mine)))
            donors.append(Donor(
                pool.name, pool.priority, shape, running=running, floor=floor,
                pending=len(pending),
                draining=sum(1 for j in jobs if j.pool == pool.name and j.job_id in draining),
                batch=batch, overridden=pool.name in overrides,
            ))  # fmt: skip
        after = config.poolmgr.take_gpus_after_s
        due = [w for w in waiting if w.waited_s >= after and w.reason in WAITING_FOR_GPUS]
        self.yield_to = {
            d.pool: f"pool {w.pool} (priority {w.priority}) waits for GPUs"
            for w in sorted(due, key=lambda w: w.priority)
            for d in donors
            if not d.batch and d.priority < w.priority and d.shape.covers(w.shape)
        }
        decision = choose(waiting, donors, after)
        if decision.reason != self._take_reason and decision.reason:
            log.info("GPUs for autoscaled pools: %s", decision.reason)
        self._take_reason = decision.reason
        take = decision.take
        if take is None:
            return out
        state = self.states.get(take.donor)
        before = state.target if state is not None else out.get(take.donor, 0)
        reason = f"taken {before}->{take.target}: {take.reason}"
        log.info("pool %s: autoscale %s", take.donor, reason)
        self.metrics.decisions.labels(take.donor, "taken").inc()
        if state is not None:
            new = replace(state, target=take.target, last_reason=reason, changed_at=now,
                          pressure_since=None, slack_since=None)  # fmt: skip
            self.states[take.donor] = new
            self.decisions[take.donor] = Decision(take.target, "taken", reason, new)
            self.metrics.target.labels(take.donor).set(take.target)
        out[take.donor] = take.target
        return out
