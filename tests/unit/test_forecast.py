"""Arrival-rate forecasts one cold start ahead (poolmgr/forecast.py): a trend from the last
minutes and a daily profile kept in the state dir; the autoscaler scales ahead on them."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from hpcserve.config import AutoscaleConfig
from hpcserve.poolmgr.autoscale import AutoscaleState, ReplicaSignal, Signals, decide
from hpcserve.poolmgr.forecast import PROFILES_FILE, Forecasts, time_bin

DAY = 86_400


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()  # the host's local time, as the profile


def feed(forecasts: Forecasts, start: float, seconds: int, rate: object) -> float:
    """One poll a minute of `rate(t)` requests/s from `start`; returns the time after."""
    t = start
    while t < start + seconds:
        t += 60
        forecasts.observe("chat", round(rate(t) * 60), t)  # type: ignore[operator]
    return t


def test_no_forecast_before_a_minute_measured_then_a_flat_rate_stays_flat() -> None:
    f = Forecasts(None)
    assert f.forecast("chat", 0, 300) is None
    t0 = at("2026-12-02 03:00")
    f.observe("chat", 0, t0)
    assert f.forecast("chat", t0, 300) is None
    end = feed(f, t0, 1800, lambda t: 2.0)
    assert f.rate("chat") == pytest.approx(2.0)
    assert f.forecast("chat", end, 600) == pytest.approx(2.0)


def test_a_ramp_is_extrapolated_by_its_trend() -> None:
    f = Forecasts(None)
    t0 = at("2026-12-02 03:00")
    f.observe("chat", 0, t0)
    end = feed(f, t0, 1800, lambda t: 1.0 + (t - t0) / 600)  # +0.1 req/s a minute
    level = f.rate("chat")
    assert level is not None and 3.5 < level < 4.1
    ahead = f.forecast("chat", end, 600)
    assert ahead is not None and ahead == pytest.approx(level + 1.0, rel=0.15)


def test_a_daily_profile_learnt_yesterday_forecasts_tomorrows_peak_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    def working_day(t: float) -> float:
        hour = datetime.fromtimestamp(t).hour
        return 4.0 if 9 <= hour < 17 else 1.0

    f = Forecasts(tmp_path)
    t0 = at("2026-12-01 00:00")
    f.observe("chat", 0, t0)
    end = feed(f, t0, DAY + 8 * 3600, working_day)  # a day, then until 08:00
    profile = f.profile("chat")
    assert profile is not None
    assert profile.bins[time_bin(at("2026-12-02 10:00"))] == pytest.approx(4.0, rel=0.05)
    assert profile.bins[time_bin(at("2026-12-02 03:00"))] == pytest.approx(1.0, rel=0.05)
    # At 08:00, flat for hours: the trend says 1 req/s; the profile says 4 at 09:00.
    assert f.forecast("chat", end, 3600) == pytest.approx(4.0, rel=0.1)
    assert f.forecast("chat", end, 60) == pytest.approx(1.0, rel=0.1)
    # A restarted pool manager has the profile (its level is measured again).
    again = Forecasts(tmp_path)
    assert again.profile("chat") == profile and again.rate("chat") is None
    assert (tmp_path / PROFILES_FILE).exists()


def test_an_unreadable_profile_file_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / PROFILES_FILE).write_text("[1, 2")
    assert Forecasts(tmp_path).profile("chat") is None


CFG = AutoscaleConfig(max=8, target_in_flight=4, scale_up_window_s=0, scale_up_cooldown_s=0,
                      scale_down_window_s=0, scale_down_cooldown_s=0)  # fmt: skip


def test_the_autoscaler_scales_ahead_of_the_forecast_and_not_down_before_it() -> None:
    # 2 replicas, 6 in flight at 3 req/s (2 s each): the load alone needs 2.
    now = [ReplicaSignal(3, 3, 0, 0.1)] * 2
    sig = Signals(now, rate_rps=3.0, forecast_rps=9.0, forecast_horizon_s=300)
    decision = decide(CFG, sig, AutoscaleState(target=2), 1000)
    # 9 req/s x 2 s = 18 in flight: 5 replicas at 4.
    assert decision.reason == "up 2->5: forecast 9 req/s in 300 s needs 5 for 0 s"
    # The load would fit fewer, but the forecast holds the replicas.
    quiet = Signals([ReplicaSignal(1, 1, 0, 0.1)] * 5, rate_rps=2.5, forecast_rps=9.0)
    assert decide(CFG, quiet, AutoscaleState(target=5), 2000).target == 5
    # A forecast at or below what the pool has changes nothing; no rate known: no forecast.
    assert decide(CFG, Signals(now, rate_rps=3.0, forecast_rps=3.0), AutoscaleState(target=2),
                  1000).reason == "steady at 2"  # fmt: skip
    assert decide(CFG, Signals(now, forecast_rps=30.0), AutoscaleState(target=2), 1000).target == 2
    assert "forecast 9 req/s in 300 s" in sig.summary()


def test_a_burst_shorter_than_a_quarter_hour_is_forecast_at_its_peak() -> None:
    """Yesterday 10:00-10:10 ran at 3x: tomorrow at 09:55, 600 s ahead, the forecast is the
    burst's rate, not the quarter hour's mean (which would halve it)."""

    def day_with_burst(t: float) -> float:
        local = datetime.fromtimestamp(t - 1)  # the minute that ends at t
        return 6.0 if local.hour == 10 and local.minute < 10 else 2.0

    f = Forecasts(None)
    t0 = at("2026-12-01 00:00")
    f.observe("chat", 0, t0)
    end = feed(f, t0, DAY + 9 * 3600 + 55 * 60, day_with_burst)  # a day, then until 09:55
    profile = f.profile("chat")
    assert profile is not None
    ten = time_bin(at("2026-12-02 10:00"))
    assert profile.bins[ten] == pytest.approx(2.0 + 4.0 * 10 / 15, rel=0.1)  # the mean: 4.7
    assert profile.peaks[ten] == pytest.approx(6.0, rel=0.05)
    assert f.forecast("chat", end, 600) == pytest.approx(6.0, rel=0.1)
