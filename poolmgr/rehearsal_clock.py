"""The autoscaler's clock in a rehearsal: a day compressed in time (bench/autoscale_day.py).

With `poolmgr.rehearsal_speedup` = k > 1 the pool manager gives the autoscaler
(poolmgr/autoscale_pools.py) not the time but a clock that reads `rehearsal_day_start` at
the real time `rehearsal_real_start` and runs k times faster: every time constant of the
autoscaler (its windows and cooldowns, idle_s, the SLO windows, the forecast's one-minute
slices and quarter hours of the day, schedules) then passes k times faster, so a day of
traffic replays in 24/k hours against an unchanged config. What the pool manager measures
in real seconds and hands to the autoscaler is stretched by k (the cold starts, the
router's unserved ages), and each request routed counts k times in the arrival forecast:
the compressed day keeps the real request rate, so one real second of it stands for k
seconds of the day at that rate. Engines, requests, Slurm (or the local launcher) and
everything else keep real time. Off (k = 1), `now` is the time itself. Never for a site's
production pool manager: its decisions would be k times too fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcserve.config import PoolMgrConfig


@dataclass(frozen=True)
class RehearsalClock:
    speedup: float = 1.0
    real_start: float = 0.0  # epoch s: the real time at which the clock reads day_start
    day_start: float = 0.0  # epoch s

    @classmethod
    def of(cls, config: PoolMgrConfig) -> RehearsalClock:
        return cls(config.rehearsal_speedup, config.rehearsal_real_start,
                   config.rehearsal_day_start)  # fmt: skip

    def now(self, real: float) -> float:
        """The autoscaler's time at the real time `real`."""
        if self.speedup == 1:
            return real
        return self.day_start + (real - self.real_start) * self.speedup

    def stretch(self, seconds: float) -> float:
        """A duration measured in real seconds, in the autoscaler's seconds."""
        return seconds * self.speedup
