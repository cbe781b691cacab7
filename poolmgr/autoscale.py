"""How many replicas an autoscaled interactive pool wants now (pure: the pool manager passes
what it saw, the last state and the time; nothing here reads a clock or talks to anything).

Signals, per serving replica, as the engines report them on each heartbeat (vLLM's
num_requests_running / num_requests_waiting and KV-cache usage, contracts/protocol.py
ReplicaLoad) and as the router counts them (requests in flight). A replica's load is the
larger of its engine's running + waiting and the router's in-flight count.

Capacity: a replica carries `target_in_flight` requests (autoscale config), or fewer where
the engines show they run fewer: a replica that queues requests (waiting > 0) runs all it
can, so its running count is what one replica holds (its max_num_seqs or KV room). The load
needs ceil(load / capacity) replicas, plus `warm_spares`.

Rules, every one clamped to autoscale.min..max:
- up, fast: when the engines queue more than `max_waiting_per_replica` per replica, the KV
  cache is fuller than `max_kv_usage` on average, or the load needs more replicas than the
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
- an admin's override (`hpcserve scale POOL N`) wins, unclamped, until `hpcserve scale
  --reset`; the autoscaler then resumes from that size, clamped to min..max.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from hpcserve.config import AutoscaleConfig

Direction = Literal["up", "down", "hold", "override"]


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

    def per_replica(self, target_in_flight: int) -> int:
        """What one replica carries: the config's target, or what a queueing one runs."""
        saturated = [r.running for r in self.replicas if r.waiting > 0 and r.running > 0]
        return max(1, min([target_in_flight, *saturated]))

    def summary(self) -> str:
        n = len(self.replicas)
        return (
            f"{n} serving, {self.starting} starting; {self.load} in flight, "
            f"{self.waiting} waiting, KV {self.kv_usage:.0%}"
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


def _clamp(cfg: AutoscaleConfig, n: int) -> int:
    return min(max(n, cfg.min), cfg.max)


def decide(cfg: AutoscaleConfig, sig: Signals, state: AutoscaleState, now: float) -> Decision:
    if sig.override is not None:
        return _override(sig.override, state, now)
    target = _clamp(cfg, state.target)
    if state.overridden:
        reason = f"override reset: autoscaling resumes at {target}"
        return _change(state, state.target, target, reason, now, force="override")
    if target != state.target:
        reason = f"autoscale.min..max is {cfg.min}..{cfg.max}"
        return _change(state, state.target, target, reason, now)
    if not sig.measured:
        return _hold(state, "the router did not answer: no load measured", None, None)
    n = len(sig.replicas)
    if n == 0:
        return _hold(state, "no replica serves yet: nothing to measure", pressure=None, slack=None)
    per_replica = sig.per_replica(cfg.target_in_flight)
    wanted = math.ceil(sig.load / per_replica) + cfg.warm_spares
    need = _clamp(cfg, wanted)
    pressure = _pressure(cfg, sig, target, wanted, per_replica)
    if pressure:
        since = state.pressure_since if state.pressure_since is not None else now
        held = now - since
        why = "; ".join(pressure)
        if held < cfg.scale_up_window_s:
            return _hold(state, f"{why} for {held:.0f} s of {cfg.scale_up_window_s:g} s", since)
        if now - state.up_at < cfg.scale_up_cooldown_s:
            return _hold(state, f"{why}; in the cooldown after the last scale-up", since)
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
    slack = (
        target > cfg.min
        and sig.waiting == 0
        and sig.kv_usage * target / max(target - 1, 1) < cfg.max_kv_usage
        and sig.load <= room
    )
    if not slack:
        return _hold(state, f"steady at {target}", pressure=None, slack=None)
    since = state.slack_since if state.slack_since is not None else now
    held = now - since
    why = (
        f"{sig.load} in flight fits {spare} replica(s) at <= "
        f"{cfg.scale_down_utilization:.0%} of {per_replica}"
    )
    if held < cfg.scale_down_window_s:
        return _hold(state, f"{why} for {held:.0f} s of {cfg.scale_down_window_s:g} s", None, since)
    if now - state.changed_at < cfg.scale_down_cooldown_s:
        return _hold(state, f"{why}; in the cooldown after the last change", None, since)
    return _change(state, target, target - 1, f"{why} for {held:.0f} s", now, slack=since)


def _pressure(
    cfg: AutoscaleConfig, sig: Signals, target: int, wanted: int, per_replica: int
) -> list[str]:
    n = len(sig.replicas)
    out = []
    if sig.waiting / n > cfg.max_waiting_per_replica:
        out.append(f"{sig.waiting / n:.1f} waiting per replica > {cfg.max_waiting_per_replica}")
    if sig.kv_usage > cfg.max_kv_usage:
        out.append(f"KV cache {sig.kv_usage:.0%} full > {cfg.max_kv_usage:.0%}")
    if min(wanted, cfg.max) > target:
        spares = f" + {cfg.warm_spares} spare(s)" if cfg.warm_spares else ""
        over = f" (max {cfg.max})" if wanted > cfg.max else ""
        out.append(
            f"{sig.load} in flight needs {wanted} at {per_replica} per replica{spares}{over}"
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
