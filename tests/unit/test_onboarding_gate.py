"""The parity gate as a table: scores, baseline, allowed drop, floors -> verdict and reasons."""

from __future__ import annotations

import pytest

from hpcserve.onboarding.gate import judge

KEY = ["json_valid", "fields"]


@pytest.mark.parametrize(
    ("scores", "baseline", "max_drop", "floors", "passed", "reasons"),
    [
        # same scores: parity
        ({"json_valid": 100, "fields": 80}, {"json_valid": 100, "fields": 80}, 1.0, {}, True, []),
        # exactly one point below is allowed by the default; better is always fine
        ({"json_valid": 99, "fields": 95}, {"json_valid": 100, "fields": 80}, 1.0, {}, True, []),
        (
            {"json_valid": 98.9, "fields": 80},
            {"json_valid": 100, "fields": 80},
            1.0,
            {},
            False,
            ["json_valid 98.9 is 1.10 points below the baseline's 100 (allowed: 1)"],
        ),
        # a model's own rule allows more
        ({"json_valid": 90, "fields": 80}, {"json_valid": 100, "fields": 80}, 10.0, {}, True, []),
        # a metric that is not key does not count
        (
            {"json_valid": 100, "fields": 80, "weight": 0},
            {"json_valid": 100, "fields": 80, "weight": 100},
            1.0,
            {},
            True,
            [],
        ),
        # no baseline: only the floors apply
        ({"json_valid": 50, "fields": 0}, None, 1.0, {}, True, []),
        (
            {"json_valid": 85, "fields": 0},
            None,
            1.0,
            {"json_valid": 90},
            False,
            ["json_valid 85 is below the suite's floor 90"],
        ),
        # both fail: both said
        (
            {"json_valid": 0, "fields": 0},
            {"json_valid": 100, "fields": 100},
            1.0,
            {},
            False,
            [
                "json_valid 0 is 100.00 points below the baseline's 100 (allowed: 1)",
                "fields 0 is 100.00 points below the baseline's 100 (allowed: 1)",
            ],
        ),
    ],
)
def test_the_gate(
    scores: dict[str, float],
    baseline: dict[str, float] | None,
    max_drop: float,
    floors: dict[str, float],
    passed: bool,
    reasons: list[str],
) -> None:
    ok, results, why = judge(scores, KEY, baseline=baseline, max_drop=max_drop, floors=floors)
    assert (ok, why) == (passed, reasons)
    assert [r.metric for r in results] == KEY
    assert all(r.passed for r in results) == passed
    if baseline is not None:
        assert [r.delta for r in results] == [round(scores[m] - baseline[m], 2) for m in KEY]
