"""Each autoscaled pool's arrival rate, and its forecast one cold start ahead.

Arrivals are the requests the router routed to the pool's replicas between two polls
(ReplicaInfo.routed, compared poll to poll). Two models of them:

- a trend: Holt's linear smoothing (level and slope) over one-minute slices, for the next
  minutes of a ramp;
- a daily profile: the mean rate of each quarter hour of the day (the pool manager host's
  local time), an exponentially weighted mean over the days seen (each new day weighs
  `PROFILE_WEIGHT`), kept in `<state_dir>/arrival-profiles.json` across restarts (written
  when a quarter hour ends).

The forecast `horizon_s` ahead (the pool's measured cold start: what a replica submitted now
takes to serve) is the larger of the trend's and the profile's (the current level scaled by
the ratio of the peak one-minute rate of the quarter hour then, learnt as its mean is, to
the mean rate of the quarter hour now): for an SLO, being early costs GPU-minutes, being
late costs the peak, and a 10-minute burst is a peak the quarter hour's mean would halve.
No forecast until a slice has been measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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


class Profile(msgspec.Struct):
    """A pool's mean arrival rate (requests/s) per quarter hour of the day, and the peak
    one-minute rate within it (a burst shorter than the quarter hour); None: not seen."""

    bins: list[float | None] = msgspec.field(default_factory=lambda: [None] * BINS)
    peaks: list[float | None] = msgspec.field(default_factory=lambda: [None] * BINS)


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

    def observe(self, pool: str, arrivals: int, now: float) -> None:
        """Requests that arrived for `pool` since the last call."""
        state = self._pools.setdefault(pool, _Pool(Profile()))
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
        rate = state.slice_arrivals / dt
        state.bin_peak = max(state.bin_peak, rate)
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
        """The arrival rate expected `horizon_s` from now (requests/s); None: not known."""
        state = self._pools.get(pool)
        if state is None or state.level is None:
            return None
        trend = state.level + state.slope * horizon_s
        bins, peaks = state.profile.bins, state.profile.peaks
        ahead = time_bin(now + horizon_s)
        here, there = bins[time_bin(now)], bins[ahead]
        if len(peaks) == BINS and peaks[ahead] is not None:
            there = peaks[ahead]  # the quarter hour's peak minute: a burst within it counts
        seasonal = state.level * there / here if here and there is not None else 0.0
        return max(trend, seasonal, 0.0)
