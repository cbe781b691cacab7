"""The parity gate: a candidate's key metrics against its baseline's, from one suite.

A key metric fails when it is more than `max_drop` points below the baseline's score, or
below the suite's floor for it (`min_scores`). Without a baseline only the floors apply: the
first version of a model passes on its own floors, or on none (its scores are recorded for
the next version to be compared with). A version passes when no key metric fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpcserve.modelcache.evaluations import DEFAULT_MAX_DROP, MetricResult

_EPS = 1e-9


def judge(
    scores: Mapping[str, float],
    key_metrics: Sequence[str],
    *,
    baseline: Mapping[str, float] | None,
    max_drop: float = DEFAULT_MAX_DROP,
    floors: Mapping[str, float] | None = None,
) -> tuple[bool, list[MetricResult], list[str]]:
    """(passed, one result per key metric, the reasons it failed)."""
    floors = floors or {}
    results, reasons = [], []
    for metric in key_metrics:
        score = scores.get(metric, 0.0)
        base = None if baseline is None else baseline.get(metric, 0.0)
        floor = floors.get(metric)
        why = []
        if base is not None and score < base - max_drop - _EPS:
            why.append(
                f"{metric} {score:g} is {base - score:.2f} points below the baseline's "
                f"{base:g} (allowed: {max_drop:g})"
            )
        if floor is not None and score < floor - _EPS:
            why.append(f"{metric} {score:g} is below the suite's floor {floor:g}")
        results.append(
            MetricResult(
                metric=metric,
                score=score,
                baseline=base,
                delta=None if base is None else round(score - base, 2),
                floor=floor,
                passed=not why,
            )
        )
        reasons += why
    return not reasons, results, reasons
