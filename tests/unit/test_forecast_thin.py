"""The forecast on thin data (poolmgr/forecast.py): a pool with a few requests a minute, or a
compressed day (each request counted `speedup` times), must not read Poisson noise as a
trend and extrapolate it over a cold start of 1000 s or more (issue 19: "up 3->12: forecast
12 req/s in 1116 s" while 2-3 req/s arrived)."""

from __future__ import annotations

import math
import random
from datetime import datetime

import pytest

from hpcserve.poolmgr.forecast import Forecasts

HORIZON_S = 1116.0


def poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k, p = k + 1, p * rng.random()
    return k


def start() -> tuple[Forecasts, float]:
    f = Forecasts(None)  # no daily profile: the trend alone
    t0 = datetime.fromisoformat("2026-12-02 03:00").timestamp()
    f.observe("chat", 0, t0)
    return f, t0


@pytest.mark.parametrize(
    ("rate", "unit"),
    [
        (0.05, 1.0),  # 3 requests a minute
        (0.2, 1.0),  # 12 a minute
        (0.05 * 120, 120.0),  # a compressed day: ~3 requests a minute, each counted 120 times
    ],
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_poisson_stream_and_one_more_arrival_do_not_forecast_several_times_the_rate(
    rate: float, unit: float, seed: int
) -> None:
    rng = random.Random(seed)
    f, t = start()
    highest = 0.0
    for minute in range(120):
        t += 60
        arrivals = poisson(rng, rate * 60 / unit)
        if minute == 100:
            arrivals += 1  # the single extra arrival
        f.observe("chat", round(arrivals * unit), t, unit)
        if minute >= 30:  # after half an hour measured
            ahead = f.forecast("chat", t, HORIZON_S)
            assert ahead is not None
            highest = max(highest, ahead)
    assert highest < 2.0 * rate, (highest, rate)


def test_a_real_step_in_thin_data_is_followed() -> None:
    rng = random.Random(7)
    f, t = start()
    for _ in range(60):
        t += 60
        f.observe("chat", poisson(rng, 3.0), t)  # 0.05 req/s
    for _ in range(20):
        t += 60
        f.observe("chat", poisson(rng, 12.0), t)  # 0.2 req/s
    ahead = f.forecast("chat", t, HORIZON_S)
    assert ahead is not None and ahead > 0.15


@pytest.mark.parametrize(
    ("per_minute", "expect_trend"),
    [
        (0.1, True),  # +0.1 req/s a minute from 1 req/s: a ramp far beyond the noise
        (0.001, False),  # +0.001 req/s a minute: within the Poisson noise of the counts
    ],
)
def test_the_trend_counts_when_the_counts_show_it_and_at_most_doubles_the_level(
    per_minute: float, expect_trend: bool
) -> None:
    rng = random.Random(11)
    f, t = start()
    t0 = t
    for _ in range(30):
        t += 60
        f.observe("chat", poisson(rng, 60 * (1.0 + (t - t0) / 60 * per_minute)), t)
    level = f.rate("chat")
    ahead = f.forecast("chat", t, 3600)  # an hour ahead: the ramp would reach 10 req/s
    assert level is not None and ahead is not None
    if expect_trend:
        assert ahead == pytest.approx(2 * level)  # capped
    else:
        assert ahead == pytest.approx(level)


@pytest.mark.parametrize(("rate", "unit"), [(0.05, 1.0), (0.05 * 120, 120.0)])
def test_one_arrival_more_in_a_slice_barely_moves_the_forecast(rate: float, unit: float) -> None:
    """The same Poisson stream twice, the second with one request more in one minute: the
    forecasts a cold start ahead differ by a small share of the rate (before the fix: the
    level by half of 1/60 req/s and the trend by 0.8 times the rate over 1116 s)."""
    ahead = []
    for extra in (0, 1):
        rng = random.Random(5)
        f, t = start()
        for minute in range(60):
            t += 60
            arrivals = poisson(rng, rate * 60 / unit) + (extra if minute == 59 else 0)
            f.observe("chat", round(arrivals * unit), t, unit)
        forecast = f.forecast("chat", t, HORIZON_S)
        assert forecast is not None
        ahead.append(forecast)
    assert 0.0 <= ahead[1] - ahead[0] < 0.1 * rate, ahead


@pytest.mark.parametrize(
    ("rate", "unit"),
    [
        (2.0, 1.0),  # a real pool: 120 requests a minute
        (0.05, 1.0),  # a rarely used model: 3 a minute
        (2.5, 120.0),  # a compressed day at 120x: ~1 request per minute of the day
        (5.0, 120.0),
        (5.0, 30.0),
    ],
)
def test_a_flat_quarter_hours_expected_peak_is_its_rate_whatever_each_request_counts(
    rate: float, unit: float
) -> None:
    """A flat Poisson day learnt at `unit` (each request counted that many times): each
    quarter hour's highest minute exceeds the rate by chance, by sqrt(unit) times more in a
    rehearsal; the expected peak takes that away (before: a compressed day's flat quarter
    hours read as peaks of 2.5 times their rate, and its forecast ordered for them)."""
    from hpcserve.poolmgr.forecast import BINS, expected_peak

    rng = random.Random(3)
    f = Forecasts(None)
    t = datetime.fromisoformat("2026-12-01 00:00").timestamp()
    f.observe("chat", 0, t)
    for _ in range(24 * 60 + 1):
        t += 60
        f.observe("chat", round(poisson(rng, rate * 60 / unit) * unit), t, unit)
    profile = f.profile("chat")
    assert profile is not None
    peaks = sorted(p for b in range(BINS) if (p := expected_peak(profile, b)) is not None)
    assert len(peaks) >= BINS - 1
    median = peaks[len(peaks) // 2]
    assert 0.9 * rate < median < 1.25 * rate, (median, rate)
    assert profile.noise[time_bin_of(t - 1800)] == pytest.approx(math.sqrt(unit))


def time_bin_of(at: float) -> int:
    from hpcserve.poolmgr.forecast import time_bin

    return time_bin(at)


def test_a_profile_kept_before_the_noise_scale_reads_as_a_real_pools() -> None:
    import msgspec

    from hpcserve.poolmgr.forecast import BINS, Profile, expected_peak

    old = msgspec.json.encode({"bins": [6.0] * BINS, "peaks": [9.0] * BINS})
    profile = msgspec.json.decode(old, type=Profile)
    # 360 requests a minute: the highest of 15 minutes exceeds it by ~1.74 standard deviations
    assert expected_peak(profile, 0) == pytest.approx(9.0 - 1.74 * math.sqrt(6.0 / 60), rel=0.02)
    profile.noise[0] = math.sqrt(120.0)  # learnt under a 120x rehearsal: mostly chance
    assert expected_peak(profile, 0) == 6.0


@pytest.mark.parametrize(
    ("mean", "excess"),
    [
        # E[highest of 15 Poisson(mean)] - mean, by direct sum; the normal approximation,
        # 1.74 sqrt(mean), falls ~0.3 short (more, relatively, on small counts)
        (0.0, 0.0),
        (0.1, 0.747),
        (1.25, 2.232),
        (5.0, 4.213),
        (100.0, 17.731),
        (1200.0, 60.5),
    ],
)
def test_the_chance_excess_of_a_quarter_hours_highest_minute(mean: float, excess: float) -> None:
    from hpcserve.poolmgr.forecast import poisson_max_excess

    assert poisson_max_excess(mean) == pytest.approx(excess, abs=0.01 if mean < 1000 else 0.5)
