"""Sizing from the arrival rate (poolmgr/autoscale.py, issue 19's third increment): the
queueing margin (square-root staffing), what a pool keeps on scale-down when the rate and
its forecast are known, the scale-down window tied to the measured cold start, and half the
surplus at a time; and the forecast's reading of the daily profile (poolmgr/forecast.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime

import pytest

from hpcserve.config import AutoscaleConfig
from hpcserve.poolmgr.autoscale import (
    AutoscaleState,
    Decision,
    ReplicaSignal,
    Signals,
    decide,
    replicas_for,
)
from hpcserve.poolmgr.forecast import BINS, Forecasts, Profile, expected_peak

DAY = 86_400


@pytest.mark.parametrize(
    ("in_flight", "margin", "per_replica", "need"),
    [
        (0.0, 1.5, 16, 0),  # nothing: nothing
        (100.0, 0.0, 16, 7),  # no margin: the load's slots alone (6.25)
        (100.0, 1.5, 16, 8),  # 100 + 1.5 x 10 = 115 slots
        (120.0, 1.5, 16, 9),  # 120 + 16.4 = 136.4
        (16.0, 0.0, 16, 1),  # exactly one replica's slots: one
        (16.0, 1.5, 16, 2),  # 16 + 6 = 22: a full replica queues under Poisson arrivals
        (400.0, 1.5, 16, 27),  # 400 + 30 = 430: the margin grows as sqrt, not with the load
    ],
)
def test_replicas_for_a_load_with_the_square_root_margin(
    in_flight: float, margin: float, per_replica: int, need: int
) -> None:
    assert replicas_for(in_flight, per_replica, margin) == need


@pytest.mark.parametrize(
    ("capacity", "rps", "rate", "forecast", "in_flight", "spares", "keep"),
    [
        (10, 5.0, 4.0, 4.0, 8, 0, 2),  # 2 s a request: 8 in flight, 8 + 4.2 slots
        (10, 5.0, 4.0, 12.0, 8, 0, 4),  # the forecast: 24 in flight, 24 + 7.3
        (10, 5.0, 12.0, 4.0, 8, 0, 4),  # the rate now (its load is arriving)
        (10, 5.0, 4.0, 4.0, 35, 0, 5),  # the load now (35 + 8.9)
        (10, 5.0, 4.0, 4.0, 8, 1, 3),  # and a warm spare
        (None, None, 4.0, 8.0, 8, 0, 4),  # Little's law: 2 s a request, 16 at 4; no margin
        (10, 5.0, None, 4.0, 8, 0, None),  # no rate measured: the load's rules alone
        (10, 5.0, 4.0, None, 8, 0, None),  # no forecast
        (None, None, 4.0, 4.0, 0, 0, None),  # nothing in flight: no time per request known
    ],
)
def test_what_a_pool_keeps_when_the_rate_and_its_forecast_are_known(
    capacity: int | None,
    rps: float | None,
    rate: float | None,
    forecast: float | None,
    in_flight: int,
    spares: int,
    keep: int | None,
) -> None:
    cfg = AutoscaleConfig(max=20, target_in_flight=4, warm_spares=spares)
    sig = Signals([ReplicaSignal(in_flight, in_flight, 0, 0.1)], capacity=capacity,
                  capacity_rps=rps, rate_rps=rate, forecast_rps=forecast)  # fmt: skip
    assert sig.keep_need(cfg, sig.per_replica(cfg.target_in_flight)) == keep


def test_the_forecast_scales_up_with_the_margin() -> None:
    # 21 req/s at 2 s each: 42 in flight, 42 + 9.7 slots at 10 a replica: 6 (5 without).
    cfg = AutoscaleConfig(max=8, target_in_flight=4, scale_up_window_s=0)
    sig = Signals([ReplicaSignal(10, 10, 0, 0.1)], capacity=10, capacity_rps=5.0,
                  rate_rps=5.0, forecast_rps=21.0, forecast_horizon_s=300)  # fmt: skip
    decision = decide(cfg, sig, AutoscaleState(target=2), 1000)
    assert decision.reason == "up 2->6: forecast 21 req/s in 300 s needs 6 for 0 s"


CFG = AutoscaleConfig(max=20, target_in_flight=10, scale_up_window_s=10,
                      scale_down_window_s=300, scale_down_cooldown_s=120)  # fmt: skip


def quiet(horizon_s: float, forecast: float = 2.0, rate: float = 2.0) -> Signals:
    """10 replicas, 4 in flight, 2 req/s at 2 s each (capacity 10 at 5 req/s): keep 1."""
    return Signals([ReplicaSignal(1, 1, 0, 0.05)] * 4 + [ReplicaSignal(0, 0, 0, 0.0)] * 6,
                   capacity=10, capacity_rps=5.0, rate_rps=rate, forecast_rps=forecast,
                   forecast_horizon_s=horizon_s)  # fmt: skip


def run(sig: Signals, target: int, seconds: int, cfg: AutoscaleConfig = CFG) -> list[Decision]:
    state, out = AutoscaleState(target=target), []
    for t in range(seconds + 1):
        decision = decide(cfg, sig, state, 1000.0 + t)
        state = decision.state
        out.append(decision)
    return out


@pytest.mark.parametrize(
    ("horizon_s", "first_down_s", "steps"),
    [
        # A 240 s cold start: a 120 s window, then 60 s between steps; half the surplus
        # each time: 10 -> 6 -> 4 -> 3 -> 2 -> 1.
        (240.0, 120, [(120, "down 10->6"), (180, "down 6->4"), (240, "down 4->3"),
                      (300, "down 3->2"), (360, "down 2->1")]),
        # A cold start of 2 hours (a long Slurm queue): the config's 300 s and 120 s.
        (7200.0, 300, [(300, "down 10->6"), (420, "down 6->4"), (540, "down 4->3"),
                       (660, "down 3->2"), (780, "down 2->1")]),
        # No cold start measured yet (horizon 0): the config's as well.
        (0.0, 300, [(300, "down 10->6"), (420, "down 6->4"), (540, "down 4->3"),
                    (660, "down 3->2"), (780, "down 2->1")]),
    ],
)  # fmt: skip
def test_with_a_forecast_the_window_is_tied_to_the_cold_start_and_half_the_surplus_goes(
    horizon_s: float, first_down_s: int, steps: list[tuple[int, str]]
) -> None:
    decisions = run(quiet(horizon_s), 10, 900)
    changes = [(t, d.reason.split(":")[0]) for t, d in enumerate(decisions) if d.changed]
    assert changes == steps
    assert decisions[first_down_s].reason == (
        f"down 10->6: 4 in flight, 2 req/s now and 2 in {horizon_s:.0f} s need 1 at 10 per "
        f"replica for {first_down_s} s"
    )
    held = decisions[first_down_s - 1]
    assert held.target == 10 and f"of {min(300, horizon_s / 2 or 300):g} s" in held.reason


def test_with_a_forecast_what_the_next_cold_start_needs_is_kept() -> None:
    # The rate is low now, but 24 req/s is forecast within the cold start: 48 in flight,
    # 48 + 10.4 slots: 6 replicas kept of 10; never fewer.
    decisions = run(quiet(240.0, forecast=24.0), 10, 3600)
    assert [d.target for d in decisions if d.changed] == [8, 7, 6]
    assert decisions[-1].target == 6
    # At or above what the pool has: no scale-down at all.
    assert not any(d.changed for d in run(quiet(240.0, forecast=40.0), 10, 3600))


def test_with_a_forecast_a_load_that_swings_does_not_flap() -> None:
    """The load swings every 30 s between 2 and 6 req/s (2 s each: 4 and 12 in flight) on
    4 replicas of 10; the forecast says 6. What 6 req/s needs (12 + 5.2 slots: 2) is kept,
    and the pool neither grows nor shrinks below it back and forth."""
    state, changes = AutoscaleState(target=4), []
    for t in range(3600):
        high = (t // 30) % 2 == 0
        in_flight = 3 if high else 1
        sig = Signals([ReplicaSignal(in_flight, in_flight, 0, 0.1)] * 4, capacity=10,
                      capacity_rps=5.0, rate_rps=6.0 if high else 2.0, forecast_rps=6.0,
                      forecast_horizon_s=240)  # fmt: skip
        decision = decide(CFG, sig, state, 1000.0 + t)
        state = decision.state
        if decision.changed:
            changes.append(decision.reason.split(":")[0])
    assert changes == ["down 4->3", "down 3->2"]


# The forecast's reading of the profile (poolmgr/forecast.py).


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()  # the host's local time, as the profile


def feed(f: Forecasts, start: float, end: float, rate: object) -> float:
    """A poll every 15 s of `rate(t)` requests/s from `start` to `end`."""
    t = start
    while t < end:
        t += 15
        f.observe("chat", round(rate(t) * 15), t)  # type: ignore[operator]
    return t


def burst_day(scale: float = 1.0) -> object:
    def rate(t: float) -> float:
        local = datetime.fromtimestamp(t - 1)
        return scale * (6.0 if local.hour == 10 and 5 <= local.minute < 12 else 2.0)

    return rate


def learnt(scale: float = 1.0) -> tuple[Forecasts, float]:
    """A day with a burst 10:05-10:12 (3x), learnt; then today until 09:50 at `scale`."""
    f = Forecasts(None)
    t0 = at("2026-12-01 00:00")
    f.observe("chat", 0, t0)
    feed(f, t0, t0 + DAY, burst_day())
    return f, feed(f, t0 + DAY, at("2026-12-02 09:50"), burst_day(scale))


def test_the_current_quarter_hours_peak_counts_until_today_has_reached_it() -> None:
    f, t = learnt()
    # 09:50, 300 s ahead (x 1.25: 09:56): the 10:00 quarter hour is not reached yet.
    assert f.forecast("chat", t, 300) == pytest.approx(2.0, rel=0.1)
    # 09:57: its burst is reached; the peak less the Poisson chance of the highest minute.
    t = feed(f, t, at("2026-12-02 09:57"), burst_day())
    peak = f.forecast("chat", t, 300)
    assert peak is not None and 5.0 < peak < 6.0
    # 10:02: in the quarter hour, before the burst came: its peak still counts.
    t = feed(f, t, at("2026-12-02 10:02"), burst_day())
    assert f.forecast("chat", t, 60) == pytest.approx(peak, rel=0.01)
    # 10:14: the burst came and went: the trend of the rate now, not the peak.
    t = feed(f, t, at("2026-12-02 10:14"), burst_day())
    after = f.forecast("chat", t, 60)
    assert after is not None and after < 4.0


def test_a_busier_day_scales_the_profile_by_the_last_quarter_hour() -> None:
    # Today runs at 1.5x yesterday: the quarter hour before 09:50 says so, and the burst
    # ahead is forecast at 1.5x its peak.
    f, t = learnt(scale=1.5)
    t = feed(f, t, at("2026-12-02 09:57"), burst_day(1.5))
    busy = f.forecast("chat", t, 300)
    g, u = learnt()
    u = feed(g, u, at("2026-12-02 09:57"), burst_day())
    usual = g.forecast("chat", u, 300)
    assert busy is not None and usual is not None
    assert busy == pytest.approx(1.5 * usual, rel=0.1)


@pytest.mark.parametrize(
    ("mean", "peak", "expected"),
    [
        # its peak less the chance part: what the highest of 15 Poisson minutes exceeds
        # their rate by (1,200 a minute: 60.5, about 1.74 standard deviations)
        (20.0, 22.0, 22.0 - 60.515 / 60),
        (4.0, 6.0, 6.0 - 27.269 / 60),  # a burst within it
        (4.0, None, 4.0),  # a profile written before peaks were kept: the mean
        (20.0, 20.5, 20.0),  # a flat quarter hour: never below its mean
        (None, 6.0, None),  # not seen
    ],
)
def test_a_quarter_hours_expected_peak(
    mean: float | None, peak: float | None, expected: float | None
) -> None:
    profile = Profile(bins=[mean] * BINS, peaks=[peak] * BINS)
    got = expected_peak(profile, 40)
    assert got == (pytest.approx(expected, rel=1e-4) if expected is not None else None)


@pytest.mark.parametrize(
    ("before", "waiting", "horizon_s", "target", "reason"),
    [
        # 4 replicas of 10, each running 10; the queue went from 20 to 40 waiting in 5 s
        # (4/s): in a 100 s cold start 400 more wait; 80 + 400 in flight need 48, max 20.
        (20, 40, 100.0, 20, "up 4->20: 10.0 waiting per replica > 2; 80 in flight and 400 "
         "more waiting in 100 s (the queue grows 4/s) needs 48 at 10 per replica (max 20) for 0 s"),
        # In a 10 s cold start 40 more: 120 need 12.
        (20, 40, 10.0, 12, "up 4->12: 10.0 waiting per replica > 2; 80 in flight and 40 "
         "more waiting in 10 s (the queue grows 4/s) needs 12 at 10 per replica for 0 s"),
        # The queue does not grow: the load alone (80 need 8).
        (40, 40, 100.0, 8, "up 4->8: 10.0 waiting per replica > 2; 80 in flight needs 8 at "
         "10 per replica for 0 s"),
        # No cold start measured: nothing to project it over.
        (20, 40, 0.0, 8, "up 4->8: 10.0 waiting per replica > 2; 80 in flight needs 8 at 10 "
         "per replica for 0 s"),
        # At max_waiting_per_replica (2 each): not a rise the forecast missed, whatever its
        # growth; the load alone (48 need 5).
        (0, 8, 100.0, 5, "up 4->5: 48 in flight needs 5 at 10 per replica for 0 s"),
    ],
)  # fmt: skip
def test_a_growing_queue_asks_for_what_it_will_hold_one_cold_start_later(
    before: int, waiting: int, horizon_s: float, target: int, reason: str
) -> None:
    cfg = AutoscaleConfig(max=20, target_in_flight=10, scale_up_window_s=0,
                          scale_up_cooldown_s=0, max_kv_usage=1.0)  # fmt: skip

    def sig(queued: int) -> Signals:
        running = 10 if queued else 2
        return Signals([ReplicaSignal(running + queued // 4, running, queued // 4, 0.5)] * 4,
                       forecast_horizon_s=horizon_s)  # fmt: skip

    first = decide(cfg, sig(before), AutoscaleState(target=4, pressure_since=0.0), 1000.0)
    assert first.state.queue == (1000.0, before)
    state = replace(first.state, target=4, up_at=-math.inf)
    decision = decide(cfg, sig(waiting), state, 1005.0)
    assert (decision.target, decision.reason) == (target, reason)
    # Nothing measured: nothing kept to compare the next poll's queue with.
    assert decide(cfg, Signals([], measured=False), state, 1010.0).state.queue is None


def test_a_rarely_used_pools_profile_is_not_scaled_by_a_handful_of_requests() -> None:
    """Yesterday 0.01 req/s until 10:00 (9 a quarter hour), 0.05 after. Today the quarter
    hour before 09:58 brings 3x that by chance: too few to say today is busier, so the
    rise ahead is forecast as learnt (0.05), not at 3x (0.15)."""

    def rare(scale: float) -> object:
        return lambda t: 0.05 if datetime.fromtimestamp(t - 1).hour >= 10 else 0.01 * scale

    def feed_counts(f: Forecasts, start: float, end: float, rate: object) -> float:
        t, total = start, 0.0
        while t < end:
            t += 15
            before, total = total, total + rate(t) * 15  # type: ignore[operator]
            f.observe("chat", math.floor(total) - math.floor(before), t)
        return t

    f = Forecasts(None)
    t0 = at("2026-12-01 00:00")
    f.observe("chat", 0, t0)
    t = feed_counts(f, t0, t0 + DAY, rare(1.0))
    t = feed_counts(f, t, at("2026-12-02 09:58"), rare(3.0))
    ahead = f.forecast("chat", t, 300)
    assert ahead is not None and 0.04 < ahead < 0.08
