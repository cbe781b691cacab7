"""The staged rollout's decision (poolmgr/rollout.py), as tables: steps, holds, breaches,
pause and resume, and a restart in the middle (the state through its file format)."""

from __future__ import annotations

import math

import msgspec
import pytest

from hpcserve.config import RolloutConfig, parse_config, rollout_steps_problem
from hpcserve.poolmgr import rollout as ro

CFG = RolloutConfig(min_answers=10, min_structured=5)
NEW, OLD = "docs@2", "docs@1"
BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, math.inf)


def counters(source: str = "gw", **versions: dict[str, float]) -> dict[str, float]:
    """Counters of one gateway: version -> {name: value}; ttft=(s, n) puts n answers of s."""
    out: dict[str, float] = {}
    for version, values in versions.items():
        ref = version.replace("_", "@")
        for name, value in values.items():
            if name == "ttft":
                seconds, n = value  # type: ignore[misc]
                for bound in BOUNDS:
                    le = "+Inf" if math.isinf(bound) else repr(bound)
                    out[ro.counter_key(source, "ttft", ref, le)] = n if seconds <= bound else 0
            else:
                out[ro.counter_key(source, name, ref)] = value
    return out


def started(**fields: object) -> ro.Rollout:
    base = ro.Rollout(alias="extraction", ref=NEW, stable=OLD, steps=[1, 5, 25, 100], every_s=60)
    return msgspec.structs.replace(base, **fields)  # type: ignore[arg-type]


def holding(step: int = 0, since: float = 0.0, baseline: dict[str, float] | None = None):
    return started(state=ro.HOLDING, step=step, step_since=since, baseline=baseline or {})


GOOD = {"answers": 100, "errors": 0, "truncations": 2}


@pytest.mark.parametrize(
    ("rollout", "seen", "now", "state", "step", "change", "logged"),
    [
        # pending: the first step at once, whatever the metrics say
        (started(), counters(docs_1=GOOD), 0, ro.HOLDING, 0, 1, "step 1 of 4 at 1%"),
        (started(), None, 0, ro.HOLDING, 0, 1, "step 1 of 4 at 1%"),
        # held long enough with enough answers: the next step
        (holding(0), counters(docs_1=GOOD, docs_2=GOOD), 60, ro.HOLDING, 1, 5, "step 2 of 4"),
        # not held long enough, or too few answers of the new version: hold
        (holding(0), counters(docs_1=GOOD, docs_2=GOOD), 59, ro.HOLDING, 0, None, ""),
        (holding(0), counters(docs_1=GOOD, docs_2={"answers": 9}), 600, ro.HOLDING, 0, None, ""),
        # no metrics: nothing judged, nothing advances
        (holding(0), None, 600, ro.HOLDING, 0, None, ""),
        # the last step is 100: the alias points at the new version
        (holding(2), counters(docs_1=GOOD, docs_2=GOOD), 60, ro.COMPLETED, 3, 100, "completed"),
        # a breach rolls back at once, before the hold is over
        (
            holding(1),
            counters(docs_1=GOOD, docs_2={"answers": 20, "errors": 3}),
            1,
            ro.ROLLED_BACK,
            1,
            0,
            "rolled back at 5%: error rate 15.0% over stable 0.0% + 1 points",
        ),
        (
            holding(1),
            counters(docs_1=GOOD, docs_2={"answers": 20, "truncations": 3}),
            1,
            ro.ROLLED_BACK,
            1,
            0,
            "truncation rate 15.0% over stable 2.0% + 5 points",
        ),
        (
            holding(0),
            counters(
                docs_1={"answers": 100, "structured": 50, "structured_invalid": 1},
                docs_2={"answers": 10, "structured": 10, "structured_invalid": 2},
            ),
            1,
            ro.ROLLED_BACK,
            0,
            0,
            "JSON validity 80.0% under stable 98.0% - 2 points",
        ),
        (
            holding(0),
            counters(
                docs_1={"answers": 50, "ttft": (0.05, 50)},
                docs_2={"answers": 10, "ttft": (0.5, 10)},
            ),
            1,
            ro.ROLLED_BACK,
            0,
            0,
            "TTFT p95",
        ),
        # within bounds: the same rates, a TTFT within ratio and slack
        (
            holding(0),
            counters(
                docs_1={"answers": 50, "errors": 1, "ttft": (0.1, 50)},
                docs_2={"answers": 10, "ttft": (0.1, 10)},
            ),
            1,
            ro.HOLDING,
            0,
            None,
            "",
        ),
        # a paused rollout is still watched (a breach rolls back) but never advances
        (
            started(state=ro.PAUSED, step=0, baseline={}),
            counters(docs_2={"answers": 10, "errors": 9}),
            1,
            ro.ROLLED_BACK,
            0,
            0,
            "rolled back",
        ),
        (
            started(state=ro.PAUSED, step=0, baseline={}),
            counters(docs_1=GOOD, docs_2=GOOD),
            600,
            ro.PAUSED,
            0,
            None,
            "",
        ),
        # finished rollouts stay as they are
        (
            started(state=ro.ROLLED_BACK, step=1),
            counters(docs_2=GOOD),
            600,
            ro.ROLLED_BACK,
            1,
            None,
            "",
        ),
    ],
)
def test_a_check_decides(rollout, seen, now, state, step, change, logged) -> None:
    decision = ro.decide(rollout, seen, now, CFG)
    assert decision.rollout.state == state
    assert decision.rollout.step == step
    assert (decision.change.share if decision.change else None) == change
    assert logged in decision.log
    assert bool(decision.log) == bool(logged)


def test_the_window_is_the_steps_own_and_survives_gateway_restarts() -> None:
    # Answers before the step began are not the step's: 30 errors then, none since.
    base = counters(docs_1={"answers": 100}, docs_2={"answers": 40, "errors": 30})
    now = counters(docs_1={"answers": 200}, docs_2={"answers": 60, "errors": 30})
    assert ro.window(now, base, NEW) == ro.Stats(answers=20, errors=0)
    # A gateway that restarted (its counters went down) counts from zero; two gateways add up.
    restarted = counters(docs_2={"answers": 5, "errors": 1})
    other = counters("gw2", docs_2={"answers": 7})
    stats = ro.window({**restarted, **other}, base, NEW)
    assert (stats.answers, stats.errors) == (12, 1)


def test_a_thin_baseline_is_strict() -> None:
    # The stable version answered too little to be a baseline: its rate counts as 0.
    seen = counters(docs_1={"answers": 3, "errors": 3}, docs_2={"answers": 10, "errors": 1})
    decision = ro.decide(holding(0), seen, 1, CFG)
    assert decision.rollout.state == ro.ROLLED_BACK
    assert "over stable 0.0%" in decision.rollout.reason


def test_pause_resume_and_abort() -> None:
    r = holding(1, since=0)
    paused = ro.pause(r, 30)
    assert (paused.state, paused.share) == (ro.PAUSED, 5)
    resumed = ro.resume(paused, 100)
    assert (resumed.state, resumed.step_since) == (ro.HOLDING, 100)  # the hold starts over
    seen = counters(docs_1=GOOD, docs_2=GOOD)
    assert ro.decide(resumed, seen, 159, CFG).rollout.step == 1
    assert ro.decide(resumed, seen, 160, CFG).rollout.step == 2
    aborted = ro.abort(resumed, 101)
    assert (aborted.state, aborted.share, aborted.active) == (ro.ABORTED, 0, False)
    # paused before the first step: resumed, it is pending again
    assert ro.resume(ro.pause(started(), 1), 2).state == ro.PENDING


def test_a_restart_resumes_the_step_from_the_state_file() -> None:
    """The Rollout is all the state: through its JSON (the state file) and back, the next
    check sees the same step, the same hold and the same window."""
    first = ro.decide(started(), counters(docs_1=GOOD), 1000, CFG).rollout
    restored = msgspec.json.decode(msgspec.json.encode(first), type=ro.Rollout)
    assert restored == first
    # The step's window counts from the baseline taken when it began, not from the restart.
    later = counters(docs_1={"answers": 200}, docs_2={"answers": 10, "errors": 5})
    assert ro.decide(restored, later, 1001, CFG).rollout.state == ro.ROLLED_BACK
    good = counters(docs_1={"answers": 200}, docs_2={"answers": 10})
    assert ro.decide(restored, good, 1059, CFG).rollout.step == 0
    assert ro.decide(restored, good, 1060, CFG).rollout.step == 1


def test_metrics_read_late_give_the_step_its_baseline_then() -> None:
    entered = ro.decide(started(), None, 0, CFG).rollout
    assert entered.baseline is None and entered.share == 1
    seen = counters(docs_2={"answers": 500, "errors": 400})  # before the step: not judged
    based = ro.decide(entered, seen, 5, CFG).rollout
    assert based.state == ro.HOLDING and based.baseline == seen


@pytest.mark.parametrize(
    ("buckets", "p95"),
    [
        (((0.1, 0), (0.2, 100), (math.inf, 100)), 0.195),
        (((0.1, 100), (math.inf, 100)), 0.095),
        (((0.1, 0), (math.inf, 10)), 0.1),  # in the +Inf bucket: its lower bound
        ((), None),
    ],
)
def test_quantile_reads_like_prometheus(buckets, p95) -> None:
    found = ro.quantile(0.95, buckets)
    assert found == (pytest.approx(p95) if p95 is not None else None)


@pytest.mark.parametrize(
    ("steps", "problem"),
    [
        ([1, 5, 25, 50, 100], ""),
        ([100], ""),
        ([], "at least one"),
        ([5, 1, 100], "rise"),
        ([1, 50], "last step must be 100"),
        ([0, 100], "from 1 to 100"),
        ([1, 101], "from 1 to 100"),
    ],
)
def test_steps_are_checked(steps, problem) -> None:
    assert (
        (problem in rollout_steps_problem(steps)) if problem else not rollout_steps_problem(steps)
    )


def test_the_config_names_bad_steps() -> None:
    with pytest.raises(ValueError, match=r"rollout.steps: the last step must be 100"):
        parse_config({"rollout": {"steps": [1, 50]}})


def test_the_gateway_families_are_the_ones_read() -> None:
    from prometheus_client import CollectorRegistry

    from hpcserve.gateway.metrics import GatewayMetrics

    registry = CollectorRegistry()
    m = GatewayMetrics(registry)
    m.answers.labels("a", "b", "").inc()
    m.deployment_ttft.labels("a", "b", "").observe(0.1)
    names = {s.name for metric in registry.collect() for s in metric.samples}
    assert set(ro.FAMILIES) - names <= {
        "hpcserve_gateway_deployment_errors_total",
        "hpcserve_gateway_deployment_truncations_total",
        "hpcserve_gateway_deployment_structured_total",
        "hpcserve_gateway_deployment_structured_invalid_total",
    }  # families without a child yet have no samples
    for family in ("errors", "truncations", "structured", "structured_invalid"):
        getattr(m, {"errors": "answer_errors"}.get(family, family)).labels("a", "b", "").inc()
    names = {s.name for metric in registry.collect() for s in metric.samples}
    assert set(ro.FAMILIES) <= names
