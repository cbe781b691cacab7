"""Auto-resume bookkeeping for `hpcserve health check --drain` (pure step, small state file).

A node is resumed only when hpcserve drained it (its reason starts with "hpcserve:"; a node
an admin drained is never touched) and it passed `needed` clean checks in a row. Any
finding at drain level, or the node not being drained, starts the count again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hpcserve.contracts.health_policy import drained_by_hpcserve


@dataclass(frozen=True)
class ResumeStep:
    clean_checks: int  # the new count to keep
    resume: bool
    why: str


def resume_step(
    clean_checks: int, *, healthy: bool, drained: bool, reason: str, needed: int
) -> ResumeStep:
    if needed <= 0:
        return ResumeStep(0, False, "auto-resume off")
    if not drained:
        return ResumeStep(0, False, "not drained")
    if not drained_by_hpcserve(reason):
        return ResumeStep(
            0, False, f"drained by someone else ({reason or 'no reason'}): never resumed"
        )
    if not healthy:
        return ResumeStep(0, False, "not clean: count starts again")
    count = clean_checks + 1
    if count >= needed:
        return ResumeStep(0, True, f"{count} clean checks in a row")
    return ResumeStep(count, False, f"clean check {count} of {needed}")


def read_count(path: Path) -> int:
    try:
        value = json.loads(path.read_text()).get("clean_checks", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value >= 0 else 0


def write_count(path: Path, count: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"clean_checks": count}))
    tmp.replace(path)
