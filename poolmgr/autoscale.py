"""How many replicas an autoscaled interactive pool wants now (pure: the pool manager passes
what it saw, the last state and the time; nothing here reads a clock or talks to anything).

Signals, per serving replica, as the engines report them on each heartbeat (vLLM's
num_requests_running / num_requests_waiting and KV-cache usage, contracts/protocol.py
ReplicaLoad) and as the router counts them (requests in flight). A replica's load is the
larger of its engine's running + waiting and the router's in-flight count. A prefill or
decode pool reads only the signals of its role (poolmgr/autoscale_roles.py: prefill on
waiting and TTFT, decode on KV usage, waiting and TPOT; `Signals.watches`).

Capacity: a replica carries what the capacity planner gives for the pool's workload at its
SLO (autoscale.capacity, poolmgr/autoscale_capacity.py; else the config's
`target_in_flight`), replaced by the batch at which the pool's engines' TPOT p95 reaches the
SLO once enough requests ran at enough batches (poolmgr/batch_limit.py), or fewer where the
engines show they run fewer: a replica that queues requests (waiting > 0) runs all it can,
so its running count is what one replica holds (its max_num_seqs or KV room). The load
needs ceil(load / capacity) replicas, plus `warm_spares`; a forecast rate needs its
requests in flight (rate x a request's time in a replica, Little's law) over the capacity:
that time measured on the pool's own engines once enough requests ran
(poolmgr/request_time.py), else the model's (its in flight over its requests/s), else the
load now over the rate now.

Rules, every one clamped to autoscale.min..max:
- up, fast: when the engines queue more than `max_waiting_per_replica` per replica, the KV
  cache is fuller than `max_kv_usage` on average, the TTFT or TPOT p95 is above the SLO
  over both the short and the long window (SLO burn), or the load needs more replicas than the
  target, continuously for `scale_up_window_s` and `scale_up_cooldown_s` after the last
  scale-up: straight to what the load needs (at least one more; none while replicas are
  still starting and they would cover the need);
- down, slowly: when the load fits one replica fewer (less the warm spares) at
  `scale_down_utilization` of the capacity, nothing waits and the KV cache spread over one
  replica fewer stays below `max_kv_usage`, continuously for `scale_down_window_s`, and
  `scale_down_cooldown_s` after the last change of either kind: one replica fewer (the
  pool manager drains it); the gap between the up and down thresholds is the hysteresis
  that keeps it from flapping;
- no serving replica, or no answer from the router this poll: hold (nothing to measure; a
  pool whose replicas are all starting must not shrink, nor one whose load is unknown);
- scale to zero (`min` = 0): the step-by-step rule above stops at one replica; the pool goes
  to zero (its replicas drain; a job still pending is cancelled) once nothing is in flight
  and no request has come for `idle_s` (requests routed to its replicas, and Routes that
  found none), `scale_down_cooldown_s` after the last change. At zero, a request that found
  no replica (the router's unserved demand) after the pool went to zero, and within
  `idle_s`, wakes it at once: 0 -> 1 + warm_spares, no window (the cold start is the wait);
- an admin's scheduled floor (autoscale.schedule, poolmgr/autoscale_schedule.py, raised
  ahead of its start by the pool's measured cold start) lifts min while it applies: a target
  below it goes up to it at once; scale-downs and scale to zero stop at it;
- an admin's override (`hpcserve scale POOL N`) wins, unclamped, until `hpcserve scale
  --reset`; the autoscaler then resumes from that size, clamped to min..max;
- while a pool of higher priority waits for GPUs (poolmgr/gpu_take.py), no scale-up: the
  pool would compete for the GPUs it may have just given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from hpcserve.config import AutoscaleConfig
from hpcserve.poolmgr.autoscale_roles import watches
from hpcserve.poolmgr.batch_limit import BatchLimit
from hpcserve.poolmgr.request_time import MeasuredTime

# With a forecast, the scale-down window's share of the forecast horizon (the pool's
# measured cold start), at most scale_down_window_s (docs/benchmarks.md, issue 19 third
# increment: 1/2 against the fixed 300 s).
DOWN_WINDOW_SHARE = 0.5

# "taken": a replica given to a pool of higher priority waiting for GPUs (gpu_take.py).
Direction = Literal["up", "down", "hold", "override", "taken"]


@dataclass(frozen=True)
class ReplicaSignal:
    in_flight: int  # the router's count of requests routed to it and not finished
    running: int  # the engine's num_requests_running
    waiting: int  # the engine's num_requests_waiting
    kv_usage: float  # the engine's KV-cache usage, 0..1

    @property
    def load(self) -> int:
        return max(self.in_flight, self.running + self.waiting)


@dataclass(frozen=True)
class Signals:
    replicas: Sequence[ReplicaSignal]  # the pool's serving replicas
    starting: int = 0  # its live jobs that do not serve yet (pending in Slurm, loading)
    override: int | None = None  # `hpcserve scale`'s replicas for the pool, if set
    measured: bool = True  # False: the router did not answer this poll (no fresh load)
    # Seconds since a request last came for the pool (routed to a replica, or a Route that
    # found none); None: not known yet. Scale to zero only.
    idle_s: float | None = None
    # Seconds since the router last answered a Route for the pool's model without a replica
    # (ReplicaList.unserved); None: none within the router's memory.
    unserved_age_s: float | None = None
    # The admin's scheduled floor now (0: none), and why (autoscale_schedule.py).
    floor: int = 0
    floor_reason: str = ""
    # The pool's TTFT and TPOT p95 over autoscale.slo_short_window_s and slo_long_window_s
    # (poolmgr/slo_windows.py); None: too few requests in the window, or not reported.
    ttft_p95_short: float | None = None
    ttft_p95_long: float | None = None
    tpot_p95_short: float | None = None
    tpot_p95_long: float | None = None
    # Arrivals (requests/s) now and forecast `forecast_horizon_s` ahead, the pool's cold
    # start (poolmgr/forecast.py); None: not known yet.
    rate_rps: float | None = None
    forecast_rps: float | None = None
    forecast_horizon_s: float = 0.0
    # What one replica sustains (poolmgr/autoscale_capacity.py: the planner's roofline or
    # calibration at the pool's SLO, else the config's target_in_flight): requests in flight,
    # requests/s at that load (None: not modelled) and where the numbers come from.
    capacity: int | None = None
    capacity_rps: float | None = None
    capacity_source: str = ""
    # A request's time running in a replica, measured on the pool's engines (Little's law,
    # poolmgr/request_time.py); None: too few requests yet (the model's time holds).
    request_time: MeasuredTime | None = None
    # The batch at which a replica's TPOT p95 reaches the SLO, measured on the pool's engines
    # (poolmgr/batch_limit.py); None: the window cannot say (the capacity above holds).
    batch_limit: BatchLimit | None = None
    # A pool of higher priority waits for GPUs (poolmgr/gpu_take.py): this one does not grow
    # (it would compete for the same GPUs); "": none waits.
    yield_to: str = ""
    # The pool's role: a prefill or decode pool scales on its own signals only
    # (poolmgr/autoscale_roles.py: prefill on waiting and TTFT, decode on KV, waiting, TPOT).
    role: str = "interactive"

    def watches(self, signal: str) -> bool:
        return watches(self.role, signal)

    @property
    def load(self) -> int:
        return sum(r.load for r in self.replicas)

    @property
    def waiting(self) -> int:
        return sum(r.waiting for r in self.replicas)

    @property
    def kv_usage(self) -> float:
        n = len(self.replicas)
        return sum(r.kv_usage for r in self.replicas) / n if n else 0.0

    def carried(self, target_in_flight: int) -> tuple[int, bool]:
        """What one replica carries within the SLO, before the engines' queueing: the
        measured batch at the TPOT SLO where it says (poolmgr/batch_limit.py), else the
        modelled capacity, else the config's target; and whether it is a limit the load must
        stay under (measured or modelled) rather than the admin's target."""
        prior = self.capacity or target_in_flight
        modelled = bool(self.capacity and self.capacity_rps)
        if self.batch_limit is None:
            return prior, modelled
        measured = self.batch_limit.capacity(prior)
        return measured, modelled or measured != prior

    def per_replica(self, target_in_flight: int, queued_over: int = 0) -> int:
        """What one replica carries (`carried`), or what a queueing one runs, whichever is
        lower. A replica queues when more than `queued_over` requests wait in it (the pool's
        max_waiting_per_replica): a request or two waiting for the engine's next step, or
        behind a long prompt's prefill, is how any busy engine looks at a random instant,
        not a limit (issue 19's compressed day: one such replica running 1 sized the whole
        pool at 1 per replica, 9->24)."""
        full = [r.running for r in self.replicas if r.waiting > queued_over and r.running > 0]
        return max(1, min([self.carried(target_in_flight)[0], *full]))

    def capacity_text(self, target_in_flight: int, queued_over: int = 0) -> str:
        """One replica's capacity and its source, for `hpcserve status`."""
        modelled = self.capacity or target_in_flight
        rate = f", {self.capacity_rps:.3g} req/s" if self.capacity_rps else ""
        source = self.capacity_source or "config target_in_flight, not modelled"
        carried = self.carried(target_in_flight)[0]
        if self.batch_limit is not None:
            text = (
                f"one replica sustains {carried} in flight (measured: "
                f"{self.batch_limit.describe()}; before: {modelled}{rate}, {source})"
            )
        else:
            text = f"one replica sustains {modelled} in flight{rate} ({source})"
        now = self.per_replica(target_in_flight, queued_over)
        if now < carried:
            text += f"; its engines queue at {now} running, so {now} holds now"
        if self.request_time is not None:
            text += f"; a request runs {self.request_time.describe()}"
            if self.capacity and self.capacity_rps:
                text += f" (the model: {self.capacity / self.capacity_rps:.3g} s)"
        return text

    def summary(self) -> str:
        n = len(self.replicas)
        floor = f"; schedule floor {self.floor}" if self.floor else ""
        if self.forecast_rps is not None:
            floor += f"; forecast {self.forecast_rps:.3g} req/s in {self.forecast_horizon_s:.0f} s"
        slo = "".join(
            f"; {name} p95 {value:.3g} s"
            for name, value in (("TTFT", self.ttft_p95_short), ("TPOT", self.tpot_p95_short))
            if value is not None and self.watches(name.lower())
        )
        return (
            f"{n} serving, {self.starting} starting; {self.load} in flight, "
            f"{self.waiting} waiting, KV {self.kv_usage:.0%}{slo}{floor}"
        )

    def margin(self, cfg: AutoscaleConfig) -> float:
        """The queueing margin: on a measured or modelled capacity (the largest batch within
        the SLO, a limit the load must stay under), none on the config's target_in_flight
        (a target the admin set below the limit)."""
        return cfg.queueing_margin if self.carried(cfg.target_in_flight)[1] else 0.0

    def request_s(self) -> float | None:
        """Seconds a request spends in a replica: measured on the pool's engines over the
        last hour (request_time), else the model's (its in flight over its requests/s), else
        Little's law on what is measured now (in flight over the arrival rate); None: none
        is known."""
        if self.request_time is not None:
            return self.request_time.seconds
        if self.capacity and self.capacity_rps:
            return self.capacity / self.capacity_rps
        if self.rate_rps and self.load:
            return self.load / self.rate_rps
        return None

    def forecast_need(self, cfg: AutoscaleConfig, per_replica: int) -> int:
        """Replicas the forecast rate needs (0: no forecast): its requests in flight by
        Little's law (rate x each one's time in a replica), with the queueing margin."""
        if self.forecast_rps is None or (request_s := self.request_s()) is None:
            return 0
        in_flight = self.forecast_rps * request_s
        return replicas_for(in_flight, per_replica, self.margin(cfg)) + cfg.warm_spares

    def keep_need(self, cfg: AutoscaleConfig, per_replica: int) -> int | None:
        """Replicas to keep (scale-down) when the rate is known: what the larger of the load
        now, the rate now and the forecast one cold start ahead needs with the queueing
        margin (a replica released now and needed within a cold start comes back late);
        None: no rate or forecast known (the load's rules decide alone)."""
        request_s = self.request_s()
        if self.forecast_rps is None or self.rate_rps is None or request_s is None:
            return None
        load = max(float(self.load), self.rate_rps * request_s, self.forecast_rps * request_s)
        return replicas_for(load, per_replica, self.margin(cfg)) + cfg.warm_spares

    def slo_burn(self, cfg: AutoscaleConfig) -> list[str]:
        """The SLOs burnt over both windows, as reasons."""
        out = []
        for name, short, long, slo in (
            ("TTFT", self.ttft_p95_short, self.ttft_p95_long, cfg.ttft_p95_s),
            ("TPOT", self.tpot_p95_short, self.tpot_p95_long, cfg.tpot_p95_s),
        ):
            if not self.watches(name.lower()):
                continue
            if short is not None and long is not None and short > slo and long > slo:
                out.append(
                    f"{name} p95 {short:.3g} s over {cfg.slo_short_window_s:g} s and "
                    f"{long:.3g} s over {cfg.slo_long_window_s:g} s > {slo:g} s"
                )
        return out

    def slo_short_over(self, cfg: AutoscaleConfig) -> bool:
        return (self.watches("ttft") and (self.ttft_p95_short or 0.0) > cfg.ttft_p95_s) or (
            self.watches("tpot") and (self.tpot_p95_short or 0.0) > cfg.tpot_p95_s
        )


@dataclass(frozen=True)
class AutoscaleState:
    """What the autoscaler remembers of a pool between polls."""

    target: int
    last_reason: str = ""  # the reason of the last change
    changed_at: float = -math.inf  # the last change of either kind
    up_at: float = -math.inf  # the last scale-up
    pressure_since: float | None = None  # since when the up condition has held
    slack_since: float | None = None  # since when the down condition has held
    overridden: bool = False  # the target is an admin's override
    # (time, requests waiting) at the last poll that measured the load: the queue's growth
    queue: tuple[float, int] | None = None


@dataclass(frozen=True)
class Decision:
    target: int
    direction: Direction  # "hold": the target did not change
    reason: str  # for a change, "up 2->4: ..."; for a hold, why it holds
    state: AutoscaleState  # to pass to the next call

    @property
    def changed(self) -> bool:
        return self.direction != "hold"


def initial_state(cfg: AutoscaleConfig, replicas: int, live: int) -> AutoscaleState:
    """The target at the pool manager's start: the jobs it finds (a restart during a peak
    keeps them), else the config's replicas; within min..max."""
    return AutoscaleState(target=_clamp(cfg, live or replicas))


def replicas_for(in_flight: float, per_replica: int, margin: float) -> int:
    """Replicas whose slots carry `in_flight` requests (Poisson arrivals: the offered load
    a) with square-root staffing's headroom: a + margin x sqrt(a) slots."""
    slots = in_flight + margin * math.sqrt(max(in_flight, 0.0))
    return math.ceil(slots / per_replica - 1e-9)


def _clamp(cfg: AutoscaleConfig, n: int) -> int:
    return min(max(n, cfg.min), cfg.max)


def decide(cfg: AutoscaleConfig, sig: Signals, state: AutoscaleState, now: float) -> Decision:
    decision = _decide(cfg, sig, state, now)
    queue = (now, sig.waiting) if sig.measured and sig.replicas else None
    return replace(decision, state=replace(decision.state, queue=queue))


def _decide(cfg: AutoscaleConfig, sig: Signals, state: AutoscaleState, now: float) -> Decision:
    if sig.override is not None:
        return _override(sig.override, state, now)
    target = _clamp(cfg, state.target)
    if state.overridden:
        reason = f"override reset: autoscaling resumes at {target}"
        return _change(state, state.target, target, reason, now, force="override")
    if target != state.target:
        reason = f"autoscale.min..max is {cfg.min}..{cfg.max}"
        return _change(state, state.target, target, reason, now)
    floor = min(sig.floor, cfg.max)
    if target < floor:  # a schedule's floor: known ahead, so no window and no measurement
        return _change(state, target, floor, sig.floor_reason, now)
    if not sig.measured:
        return _hold(state, "the router did not answer: no load measured", None, None)
    if (
        cfg.min == 0
        and floor == 0
        and (zero := _to_or_from_zero(cfg, sig, state, target, now)) is not None
    ):
        return zero
    n = len(sig.replicas)
    if n == 0:
        return _hold(state, "no replica serves yet: nothing to measure", pressure=None, slack=None)
    per_replica = sig.per_replica(cfg.target_in_flight, cfg.max_waiting_per_replica)
    growth = _queue_growth(cfg, sig, state, now)
    backlog = growth * sig.forecast_horizon_s  # what it will have grown by in a cold start
    wanted = math.ceil((sig.load + backlog) / per_replica) + cfg.warm_spares
    ahead = sig.forecast_need(cfg, per_replica)
    need = _clamp(cfg, max(wanted, ahead))
    pressure = _pressure(cfg, sig, target, wanted, per_replica, growth)
    if min(ahead, cfg.max) > max(target, wanted):
        pressure.append(
            f"forecast {sig.forecast_rps:.3g} req/s in {sig.forecast_horizon_s:.0f} s needs {ahead}"
        )
    if pressure:
        since = state.pressure_since if state.pressure_since is not None else now
        held = now - since
        why = "; ".join(pressure)
        if held < cfg.scale_up_window_s:
            return _hold(state, f"{why} for {held:.0f} s of {cfg.scale_up_window_s:g} s", since)
        if now - state.up_at < cfg.scale_up_cooldown_s:
            return _hold(state, f"{why}; in the cooldown after the last scale-up", since)
        if sig.yield_to:
            return _hold(state, f"{why}; {sig.yield_to}", since)
        if need > target:
            new = need
        elif sig.starting:
            return _hold(state, f"{why}; {sig.starting} replica(s) starting", since)
        else:
            new = _clamp(cfg, target + 1)
        if new == target:
            return _hold(state, f"{why}; at autoscale.max ({cfg.max})", since)
        return _change(state, target, new, f"{why} for {held:.0f} s", now)
    spare = target - 1 - cfg.warm_spares
    room = spare * per_replica * cfg.scale_down_utilization
    keep = sig.keep_need(cfg, per_replica)
    slack = (
        target > max(cfg.min, 1, floor)  # the last replica goes only when idle (to zero)
        and sig.waiting == 0
        and (not sig.watches("kv") or sig.kv_usage * target / max(target - 1, 1) < cfg.max_kv_usage)
        and not sig.slo_short_over(cfg)
        and (sig.load <= room and ahead < target if keep is None else keep < target)
    )
    if not slack:
        kept = f"; {sig.floor_reason}" if floor and target <= floor else ""
        return _hold(state, f"steady at {target}{kept}", pressure=None, slack=None)
    since = state.slack_since if state.slack_since is not None else now
    held = now - since
    window, cooldown = cfg.scale_down_window_s, cfg.scale_down_cooldown_s
    if keep is None:
        why = (
            f"{sig.load} in flight fits {spare} replica(s) at <= "
            f"{cfg.scale_down_utilization:.0%} of {per_replica}"
        )
    else:  # the forecast covers a cold start ahead: the window only filters noise
        window, cooldown = _down_timing(cfg, sig.forecast_horizon_s)
        why = (
            f"{sig.load} in flight, {sig.rate_rps:.3g} req/s now and {sig.forecast_rps:.3g} "
            f"in {sig.forecast_horizon_s:.0f} s need {keep} at {per_replica} per replica"
        )
    if held < window:
        return _hold(state, f"{why} for {held:.0f} s of {window:g} s", None, since)
    if now - state.changed_at < cooldown:
        return _hold(state, f"{why}; in the cooldown after the last change", None, since)
    # With a forecast, half the surplus at a time (at least one): a burst's replicas go in
    # a few cooldowns, not one per cooldown; without, one replica at a time.
    step = 1 if keep is None else max(1, (target - max(keep, cfg.min, floor, 1)) // 2)
    return _change(state, target, target - step, f"{why} for {held:.0f} s", now, slack=since)


def _down_timing(cfg: AutoscaleConfig, horizon_s: float) -> tuple[float, float]:
    """The scale-down window and cooldown when the forecast covers the next cold start:
    half and a quarter of that cold start, at most the config's (a replica it releases and
    that is needed again within a cold start is kept by the forecast; what the window
    filters is the rate's noise). No cold start measured yet: the config's."""
    if horizon_s <= 0:
        return cfg.scale_down_window_s, cfg.scale_down_cooldown_s
    return (
        min(cfg.scale_down_window_s, horizon_s * DOWN_WINDOW_SHARE),
        min(cfg.scale_down_cooldown_s, horizon_s * DOWN_WINDOW_SHARE / 2),
    )


def _to_or_from_zero(
    cfg: AutoscaleConfig, sig: Signals, state: AutoscaleState, target: int, now: float
) -> Decision | None:
    """A pool that may scale to zero: wake it, take it to zero, or hold it there; None:
    the ordinary rules decide."""
    if target == 0:
        age = sig.unserved_age_s
        if age is not None and age < cfg.idle_s and now - age >= state.changed_at:
            woken = _clamp(cfg, 1 + cfg.warm_spares)
            why = f"a request found no replica {age:.0f} s ago (woken from zero)"
            return _change(state, 0, woken, why, now)
        return _hold(state, "at zero: no request since it scaled to zero")
    if sig.load or sig.waiting or sig.idle_s is None or sig.idle_s < cfg.idle_s:
        return None
    if now - state.changed_at < cfg.scale_down_cooldown_s:
        return _hold(state, "idle; in the cooldown after the last change")
    return _change(state, target, 0, f"no request for {sig.idle_s:.0f} s (scale to zero)", now)


def _queue_growth(cfg: AutoscaleConfig, sig: Signals, state: AutoscaleState, now: float) -> float:
    """Requests/s the engines' queue grows by since the last poll, while it is over
    max_waiting_per_replica (arrivals beyond what the pool runs: a rise the forecast did
    not see); 0 otherwise, or without a measured cold start to project it over."""
    if state.queue is None or sig.forecast_horizon_s <= 0:
        return 0.0
    at, waiting = state.queue
    if now <= at or sig.waiting / len(sig.replicas) <= cfg.max_waiting_per_replica:
        return 0.0
    return max(0.0, (sig.waiting - waiting) / (now - at))


def _pressure(
    cfg: AutoscaleConfig,
    sig: Signals,
    target: int,
    wanted: int,
    per_replica: int,
    growth: float = 0.0,
) -> list[str]:
    n = len(sig.replicas)
    out = []
    if sig.waiting / n > cfg.max_waiting_per_replica:
        out.append(f"{sig.waiting / n:.1f} waiting per replica > {cfg.max_waiting_per_replica}")
    if sig.watches("kv") and sig.kv_usage > cfg.max_kv_usage:
        out.append(f"KV cache {sig.kv_usage:.0%} full > {cfg.max_kv_usage:.0%}")
    out += sig.slo_burn(cfg)
    if min(wanted, cfg.max) > target:
        spares = f" + {cfg.warm_spares} spare(s)" if cfg.warm_spares else ""
        over = f" (max {cfg.max})" if wanted > cfg.max else ""
        grows = (
            f" and {growth * sig.forecast_horizon_s:.0f} more waiting in "
            f"{sig.forecast_horizon_s:.0f} s (the queue grows {growth:.3g}/s)"
            if growth
            else ""
        )
        out.append(
            f"{sig.load} in flight{grows} needs {wanted} at {per_replica} per replica{spares}{over}"
        )
    return out


def _hold(
    state: AutoscaleState,
    reason: str,
    pressure: float | None = None,
    slack: float | None = None,
) -> Decision:
    kept = replace(state, pressure_since=pressure, slack_since=slack)
    return Decision(state.target, "hold", reason, kept)


def _change(
    state: AutoscaleState,
    before: int,
    after: int,
    why: str,
    now: float,
    *,
    force: Direction | None = None,
    slack: float | None = None,
) -> Decision:
    direction: Direction = force or ("up" if after > before else "down")
    if after == before and force is None:
        return _hold(state, why)
    reason = f"{direction} {before}->{after}: {why}"
    new = AutoscaleState(
        target=after,
        last_reason=reason,
        changed_at=now,
        up_at=now if direction == "up" else state.up_at,
        # A step down keeps the slack's start: the next step needs only the cooldown.
        slack_since=slack,
    )
    return Decision(after, direction, reason, new)


def _override(replicas: int, state: AutoscaleState, now: float) -> Decision:
    reason = (
        f"override {state.target}->{replicas}: admin's `hpcserve scale`; autoscaling "
        "resumes after `hpcserve scale --reset`"
    )
    if state.overridden and state.target == replicas:
        return Decision(replicas, "hold", state.last_reason, state)
    new = AutoscaleState(target=replicas, last_reason=reason, changed_at=now, overridden=True)
    return Decision(replicas, "override", reason, new)
