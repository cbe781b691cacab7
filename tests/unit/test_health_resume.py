"""Auto-resume bookkeeping: only nodes hpcserve drained, only after N clean checks in a row."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.health.resume import read_count, resume_step, write_count

OURS = "hpcserve: xid 79 gpu 3"


@pytest.mark.parametrize(
    ("count", "healthy", "drained", "reason", "needed", "expected"),
    [
        (0, True, True, OURS, 3, (1, False, "clean check 1 of 3")),
        (1, True, True, OURS, 3, (2, False, "clean check 2 of 3")),
        (2, True, True, OURS, 3, (0, True, "3 clean checks in a row")),
        (2, False, True, OURS, 3, (0, False, "not clean: count starts again")),
        (0, True, True, OURS, 1, (0, True, "1 clean checks in a row")),
        (5, True, False, "", 3, (0, False, "not drained")),
        (
            2, True, True, "bad DIMM", 3,
            (0, False, "drained by someone else (bad DIMM): never resumed"),
        ),
        (2, True, True, "", 3, (0, False, "drained by someone else (no reason): never resumed")),
        (2, True, True, OURS, 0, (0, False, "auto-resume off")),
    ],
)  # fmt: skip
def test_resume_step(
    count: int, healthy: bool, drained: bool, reason: str, needed: int, expected: tuple
) -> None:
    step = resume_step(count, healthy=healthy, drained=drained, reason=reason, needed=needed)
    assert (step.clean_checks, step.resume, step.why) == expected


def test_count_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "health-n1.json"
    assert read_count(path) == 0
    write_count(path, 2)
    assert read_count(path) == 2
    path.write_text("not json")
    assert read_count(path) == 0
    path.write_text('{"clean_checks": -4}')
    assert read_count(path) == 0
