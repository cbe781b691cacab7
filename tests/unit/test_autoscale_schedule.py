"""Admins' scheduled floors (poolmgr/autoscale_schedule.py): by weekday and time of day,
raised ahead of their start by the pool's measured cold start; the highest wins."""

from __future__ import annotations

from datetime import datetime

import pytest

from hpcserve.config import ScheduleFloor
from hpcserve.poolmgr.autoscale_schedule import scheduled_floor

WORKDAY = ScheduleFloor(start="09:00", end="18:00", min=3, days=["mon", "tue", "wed", "thu", "fri"])
LUNCH = ScheduleFloor(start="12:00", end="13:30", min=5, days=["wed"])
NIGHT = ScheduleFloor(start="22:00", end="24:00", min=1)  # every day
SCHEDULE = [WORKDAY, LUNCH, NIGHT]
# 2026-12-02 is a Wednesday.


@pytest.mark.parametrize(
    ("at", "lead_s", "floor"),
    [
        ("2026-12-02 08:59", 0, 0),  # before the start, no lead
        ("2026-12-02 08:59", 60, 3),  # the lead reaches the start
        ("2026-12-02 08:50", 599, 0),  # ... not quite
        ("2026-12-02 09:00", 0, 3),
        ("2026-12-02 11:55", 300, 5),  # Wednesday lunch, raised 5 min ahead
        ("2026-12-02 13:30", 0, 3),  # lunch ended at 13:30; the workday goes on
        ("2026-12-02 17:59", 0, 3),
        ("2026-12-02 18:00", 0, 0),  # ends at its end: no lag
        ("2026-12-02 23:59", 0, 1),  # every day, to midnight
        ("2026-12-03 12:30", 0, 3),  # Thursday: no lunch floor
        ("2026-12-05 10:00", 0, 0),  # Saturday
        ("2026-12-06 23:00", 36000, 3),  # Sunday night: a 10 h lead reaches Monday 09:00
        ("2026-12-04 20:00", 86400, 1),  # Friday 20:00, a day ahead: no workday till Monday
    ],
)
def test_floor_by_weekday_and_time_with_the_cold_start_as_lead(
    at: str, lead_s: float, floor: int
) -> None:
    assert scheduled_floor(SCHEDULE, datetime.fromisoformat(at), lead_s)[0] == floor


def test_the_reason_names_the_entry_and_the_lead() -> None:
    assert scheduled_floor(SCHEDULE, datetime.fromisoformat("2026-12-02 08:52"), 480) == (
        3,
        "schedule floor 3 (mon,tue,wed,thu,fri 09:00-18:00), raised 480 s ahead: cold start",
    )
    assert scheduled_floor([NIGHT], datetime.fromisoformat("2026-12-02 22:30")) == (
        1,
        "schedule floor 1 (daily 22:00-24:00)",
    )
    assert scheduled_floor([], datetime.fromisoformat("2026-12-02 22:30"), 1e6) == (0, "")
