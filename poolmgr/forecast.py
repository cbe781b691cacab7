"""Each autoscaled pool's arrival rate, and its forecast one cold start ahead.

Arrivals are the requests the router routed to the pool's replicas between two polls
(ReplicaInfo.routed, compared poll to poll). Two models of them:

- a trend: Holt's linear smoothing (level and slope) over one-minute slices, for the next
  minutes of a ramp; on thin data (a few arrivals a minute) the level is fed the rate of
  the last slices holding enough arrivals, and the trend counts only as far as the counts
  behind it show a change beyond Poisson noise (constants below);
- a daily profile: the mean rate of each quarter hour of the day (the pool manager host's
  local time), an exponentially weighted mean over the days seen (each new day weighs
  `PROFILE_WEIGHT`), kept in `<state_dir>/arrival-profiles.json` across restarts (written
  when a quarter hour ends).

The forecast over `horizon_s` (the pool's measured cold start: what a replica submitted now
takes to serve) is the larger of the trend's `horizon_s` ahead and the profile's: the
highest expected peak minute of the quarter hours the horizon reaches (read
`PROFILE_REACH` times as far: a rise of several replicas waits for the slowest), scaled by
today's traffic over the profile's (the quarter hour just ended, measured against its
profile mean; after a start, the level against the mean now). A quarter hour's expected
peak is its learnt peak one-minute rate less what chance adds to the highest of 15 Poisson
minutes (a 10-minute burst is a peak the quarter hour's mean would halve), of the requests
seen where each counted several times (a rehearsal: `Profile.noise`); the current
quarter hour's counts until today's peak minute has reached it (then the trend has it).
For an SLO, being early costs GPU-minutes, being late costs the peak. No forecast until a
slice has been measured.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec

from hpcserve.poolmgr.state_files import write_atomic

log = logging.getLogger(__name__)

PROFILES_FILE = "arrival-profiles.json"
BIN_S = 900  # a quarter hour
BINS = 86_400 // BIN_S
SLICE_S = 60.0  # the trend's step
LEVEL_WEIGHT = 0.5  # Holt's alpha
SLOPE_WEIGHT = 0.2  # Holt's beta
PROFILE_WEIGHT = 0.3  # a new day's weight in a quarter hour's mean
# A quarter hour's minutes: its peak minute is the highest of this many Poisson counts, and
# exceeds its rate by chance (by about 1.74 standard deviations of a minute's count where the
# counts are large, by more on a few requests a minute: poisson_max_excess).
MINUTES_PER_BIN = round(BIN_S / SLICE_S)
SEEN = 0.9  # today's peak minute at this share of the expected peak: it has come
RATIO_MIN_ARRIVALS = 30  # a quarter hour's expected arrivals to scale the profile by it
# The profile is read this far beyond the horizon (the p90 cold start): a known rise needs
# several replicas at once, and the slowest of them is what the rise waits for.
PROFILE_REACH = 1.25
# Thin data (a few arrivals a minute: a low-rate pool): a slice's rate is a Poisson count of
# a handful, and one arrival more moved the level by half of 1/60 req/s and the trend, over a
# cold start of 1000 s or more, by several times the rate. So the level is fed the rate of
# the last slices holding at least LEVEL_MIN_ARRIVALS arrivals (at most TREND_WINDOW_S); the
# trend counts only where the last TREND_WINDOW_S's rate differs from the one before by
# more than TREND_SIGMAS Poisson standard deviations, in the trend's direction, no steeper
# than the part of that change beyond them; and to at most TREND_MAX_RATIO times the level.
LEVEL_MIN_ARRIVALS = 30
TREND_WINDOW_S = float(BIN_S)
TREND_SIGMAS = 3.0
TREND_MAX_RATIO = 2.0


class Profile(msgspec.Struct):
    """A pool's mean arrival rate (requests/s) per quarter hour of the day, and the peak
    one-minute rate within it (a burst shorter than the quarter hour); None: not seen.
    `noise`: per quarter hour, the square root of the count each request had in the days its
    peak was learnt from (1 for a real pool, a rehearsal's speedup under a compressed day),
    weighted as the peaks are: a peak minute's chance excess grows with it (None: 1)."""

    bins: list[float | None] = msgspec.field(default_factory=lambda: [None] * BINS)
    peaks: list[float | None] = msgspec.field(default_factory=lambda: [None] * BINS)
    noise: list[float | None] = msgspec.field(default_factory=lambda: [None] * BINS)


def time_bin(at: float) -> int:
    local = datetime.fromtimestamp(at)
    return (local.hour * 3600 + local.minute * 60 + local.second) // BIN_S


@dataclass
class _Pool:
    profile: Profile
    level: float | None = None  # requests/s
    slope: float = 0.0  # requests/s per second
    slice_start: float | None = None
    slice_arrivals: int = 0
    bin: int | None = None  # the quarter hour being measured
    bin_start: float | None = None
    bin_arrivals: int = 0
    bin_peak: float = 0.0  # the highest one-minute rate in the quarter hour so far
    # Today's traffic over the profile's: the last full quarter hour's mean rate over the
    # profile's mean for it (before it learnt that day), and when that quarter hour ended.
    ratio: float | None = None
    ratio_at: float = 0.0
    # The last slices, newest last: (seconds, arrivals), two trend windows' worth.
    slices: deque[tuple[float, int]] = field(default_factory=deque)
    unit: float = 1.0  # arrivals counted per request seen (a rehearsal's speedup)


class Forecasts:
    def __init__(self, state_dir: Path | None) -> None:
        self.path = Path(state_dir) / PROFILES_FILE if state_dir is not None else None
        self._pools: dict[str, _Pool] = {
            name: _Pool(profile) for name, profile in self._load().items()
        }

    def _load(self) -> dict[str, Profile]:
        if self.path is None:
            return {}
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=dict[str, Profile])
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError) as err:
            log.warning("%s unreadable, daily profiles start afresh: %s", self.path, err)
            return {}

    def profile(self, pool: str) -> Profile | None:
        state = self._pools.get(pool)
        return state.profile if state is not None else None

    def rate(self, pool: str) -> float | None:
        state = self._pools.get(pool)
        return state.level if state is not None else None

    def observe(self, pool: str, arrivals: int, now: float, unit: float = 1.0) -> None:
        """Requests that arrived for `pool` since the last call; each request seen counts
        `unit` (a rehearsal's speedup: its Poisson noise is that of arrivals / unit)."""
        state = self._pools.setdefault(pool, _Pool(Profile()))
        state.unit = unit
        if state.slice_start is None:  # the first call starts the clock: its arrivals came
            state.slice_start = now  # over an unknown time before
            state.bin, state.bin_start, state.bin_arrivals = time_bin(now), now, 0
            return
        state.slice_arrivals += arrivals
        if now - state.slice_start >= SLICE_S:
            self._end_slice(state, now)
        b = time_bin(now)
        if state.bin is None or state.bin_start is None:
            state.bin, state.bin_start, state.bin_arrivals = b, now, 0
        state.bin_arrivals += arrivals
        if b != state.bin:
            self._end_bin(state, now)
            state.bin, state.bin_start, state.bin_arrivals = b, now, 0
            state.bin_peak = 0.0

    def _end_slice(self, state: _Pool, now: float) -> None:
        assert state.slice_start is not None
        dt = now - state.slice_start
        state.bin_peak = max(state.bin_peak, state.slice_arrivals / dt)
        state.slices.append((dt, state.slice_arrivals))
        while sum(span for span, _ in state.slices) - state.slices[0][0] >= 2 * TREND_WINDOW_S:
            state.slices.popleft()
        rate = _pooled_rate(state.slices, LEVEL_MIN_ARRIVALS * state.unit)
        if state.level is None:
            state.level = rate
        else:
            previous = state.level
            state.level = LEVEL_WEIGHT * rate + (1 - LEVEL_WEIGHT) * (previous + state.slope * dt)
            state.slope = (
                SLOPE_WEIGHT * (state.level - previous) / dt + (1 - SLOPE_WEIGHT) * state.slope
            )
        state.slice_start, state.slice_arrivals = now, 0

    def _end_bin(self, state: _Pool, now: float) -> None:
        assert state.bin is not None and state.bin_start is not None
        span = now - state.bin_start
        if span < BIN_S / 3:  # a sliver (a start mid-quarter): too little to learn from
            return
        rate = state.bin_arrivals / span
        old = state.profile.bins[state.bin]
        if old and span >= BIN_S * 0.9:  # today against the profile, before it learns today
            # Too few arrivals expected to tell (a rarely used model): the profile as is.
            few = old * span < RATIO_MIN_ARRIVALS * state.unit
            state.ratio, state.ratio_at = (1.0 if few else rate / old), now
        state.profile.bins[state.bin] = (
            rate if old is None else PROFILE_WEIGHT * rate + (1 - PROFILE_WEIGHT) * old
        )
        peak = max(state.bin_peak, rate)
        if len(state.profile.peaks) != BINS:  # a file written before peaks were kept
            state.profile.peaks = [None] * BINS
        old = state.profile.peaks[state.bin]
        state.profile.peaks[state.bin] = (
            peak if old is None else PROFILE_WEIGHT * peak + (1 - PROFILE_WEIGHT) * old
        )
        if len(state.profile.noise) != BINS:  # a file written before the noise was kept
            state.profile.noise = [None] * BINS
        scale = math.sqrt(state.unit)
        if old is not None:  # the old peak's, weighted as the peaks are
            before = _noise(state.profile, state.bin)
            scale = PROFILE_WEIGHT * scale + (1 - PROFILE_WEIGHT) * before
        state.profile.noise[state.bin] = scale
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        profiles = {name: state.profile for name, state in self._pools.items()}
        try:
            write_atomic(self.path, msgspec.json.encode(profiles))
        except OSError as err:
            log.warning("cannot write %s: %s", self.path, err)

    def forecast(self, pool: str, now: float, horizon_s: float) -> float | None:
        """The arrival rate expected within `horizon_s` from now, at its highest
        (requests/s); None: not known."""
        state = self._pools.get(pool)
        if state is None or state.level is None:
            return None
        trend = _trend(state, horizon_s)
        here = time_bin(now)
        mean_now = state.profile.bins[here]
        if state.ratio is not None and now - state.ratio_at <= BIN_S + SLICE_S:
            ratio = state.ratio  # the quarter hour just ended, against its profile
        elif mean_now:
            ratio = state.level / mean_now  # (after a start: the level now)
        else:
            return max(trend, 0.0)
        # The quarter hours the horizon reaches: the highest peak one of them holds. The
        # current one's counts until today's peak minute has reached it (it has come).
        local = datetime.fromtimestamp(now)
        start = now - (local.minute * 60 + local.second + local.microsecond / 1e6) % BIN_S
        expected = 0.0
        for k in range(BINS):
            if k and start + k * BIN_S > now + horizon_s * PROFILE_REACH:
                break
            b = (here + k) % BINS
            peak = expected_peak(state.profile, b)
            if peak is None:
                continue
            if k == 0 and state.bin == here and state.bin_peak >= ratio * peak * SEEN:
                continue
            expected = max(expected, peak)
        return max(trend, ratio * expected, 0.0)


def _pooled_rate(slices: deque[tuple[float, int]], enough: float) -> float:
    """The rate of the newest slices holding `enough` arrivals (the newest alone where it
    does), over TREND_WINDOW_S at most."""
    span, count = 0.0, 0
    for dt, n in reversed(slices):
        if span and (count >= enough or span + dt > TREND_WINDOW_S):
            break
        span, count = span + dt, count + n
    return count / span


def _window_rates(
    slices: deque[tuple[float, int]],
) -> tuple[tuple[float, int], tuple[float, int]] | None:
    """(seconds, arrivals) of the last trend window and of the one before it, as many slices
    each (TREND_WINDOW_S at most, at least one); None: under two slices."""
    items = list(slices)
    m, span = 0, 0.0
    while 2 * (m + 1) <= len(items) and (m == 0 or span + items[-m - 1][0] <= TREND_WINDOW_S):
        m, span = m + 1, span + items[-m - 1][0]
    if m == 0:
        return None
    recent, before = items[-m:], items[-2 * m : -m]
    return (
        (sum(dt for dt, _ in recent), sum(n for _, n in recent)),
        (sum(dt for dt, _ in before), sum(n for _, n in before)),
    )


def _trend(state: _Pool, horizon_s: float) -> float:
    """The level `horizon_s` ahead on the trend where the counts behind it show one (their
    rates differ beyond Poisson noise in the slope's direction), its slope no steeper than
    the change beyond the noise, at most TREND_MAX_RATIO times the level; the level where
    they do not."""
    assert state.level is not None
    windows = _window_rates(state.slices)
    if windows is None or state.slope == 0.0:
        return state.level
    (t1, n1), (t0, n0) = windows
    change = n1 / t1 - n0 / t0
    noise = math.sqrt(state.unit * (n1 / t1**2 + n0 / t0**2))
    if change * state.slope <= 0 or abs(change) <= TREND_SIGMAS * noise:
        return state.level
    # No steeper than the part of the windows' change beyond the noise shows (their middles
    # lie one recent window apart).
    shown = (abs(change) - TREND_SIGMAS * noise) / t1
    rise = math.copysign(min(abs(state.slope), shown), state.slope) * horizon_s
    return min(state.level + rise, TREND_MAX_RATIO * state.level)


def expected_peak(profile: Profile, b: int) -> float | None:
    """Quarter hour b's expected peak one-minute rate: its learnt peak less what Poisson
    arrivals add to the highest of its 15 minutes by chance, at least its mean; its mean
    where no peak was learnt; None: not seen. Where each request counted u times (a
    rehearsal, Profile.noise = sqrt(u)), a minute's count is u times a Poisson count of
    1/u as many requests, and the highest of 15 of those exceeds the rate by u times their
    own excess: several times a real pool's at the same rate."""
    mean = profile.bins[b]
    if mean is None:
        return None
    if len(profile.peaks) != BINS or (peak := profile.peaks[b]) is None:
        return mean
    unit = _noise(profile, b) ** 2
    per_minute = mean * SLICE_S / unit  # requests a minute, each counted `unit` times
    excess = poisson_max_excess(round(per_minute, 2)) * unit / SLICE_S
    return max(mean, peak - excess)


def _noise(profile: Profile, b: int) -> float:
    """Quarter hour b's noise scale (Profile.noise); 1 where none was kept."""
    scale = profile.noise[b] if len(profile.noise) == BINS else None
    return 1.0 if scale is None else scale


@functools.lru_cache(maxsize=4096)
def poisson_max_excess(mean: float, n: int = MINUTES_PER_BIN) -> float:
    """E[the highest of n Poisson(mean) counts] - mean: the sum over k of P(max > k) =
    1 - F(k)^n, from where F is still negligible (mean less 10 standard deviations)."""
    if mean <= 0:
        return 0.0
    spread = 10 * math.sqrt(mean) + 10
    low = max(0, int(mean - spread))
    total, cdf = float(low), 0.0
    log_mean = math.log(mean)
    for k in range(low, int(mean + spread) + 1):
        cdf = min(1.0, cdf + math.exp(k * log_mean - mean - math.lgamma(k + 1)))
        total += 1.0 - cdf**n
    return total - mean
