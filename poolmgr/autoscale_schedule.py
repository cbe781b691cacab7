"""Admins' scheduled floors of an autoscaled pool (pools[].autoscale.schedule), pure.

A floor applies from its `start` to its `end` on its days, in the pool manager host's local
time. It is raised `lead_s` ahead of its start: the pool's measured cold start
(poolmgr/cold_start.py), so the replicas it asks for serve when the peak begins, not a cold
start later. It ends at its `end` (the ordinary scale-down rules take the pool down from
there, slowly). The highest floor that applies wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, time, timedelta

from hpcserve.config import WEEKDAYS, ScheduleFloor


def _clock(value: str) -> timedelta:
    hours, minutes = value.split(":")
    return timedelta(hours=int(hours), minutes=int(minutes))


def _days(floor: ScheduleFloor) -> str:
    return ",".join(floor.days) if floor.days else "daily"


def scheduled_floor(
    schedule: Sequence[ScheduleFloor], at: datetime, lead_s: float = 0.0
) -> tuple[int, str]:
    """The floor at `at` (naive local time, or aware), looking `lead_s` ahead; and why
    ("" when none applies)."""
    best, why = 0, ""
    ahead = at + timedelta(seconds=lead_s)
    midnight = datetime.combine(at.date(), time(), at.tzinfo)
    for floor in schedule:
        if floor.min <= best:
            continue
        # The day before (a window that reaches into today) to the last day the lead reaches.
        for offset in range(-1, (ahead.date() - at.date()).days + 1):
            day = midnight + timedelta(days=offset)
            if floor.days and WEEKDAYS[day.weekday()] not in floor.days:
                continue
            start, end = day + _clock(floor.start), day + _clock(floor.end)
            if start <= ahead and end > at:
                best = floor.min
                why = f"schedule floor {floor.min} ({_days(floor)} {floor.start}-{floor.end})"
                if start > at:
                    why += f", raised {(start - at).total_seconds():.0f} s ahead: cold start"
                break
    return best, why
