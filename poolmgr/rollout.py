"""Staged rollout: the decision, pure (no clock, no I/O): a Rollout and the counters seen now
in, the Rollout after this check and the change to make to the alias out.

A rollout moves alias ALIAS from its target (the stable version) to REF in steps of canary
share (1, 5, 25, 50, 100 by default). States:

    pending --first check--> holding --held `every_s` and min_answers seen--> holding (next step)
    holding --last step (100)--> completed     (the alias points at REF)
    holding|paused --a bound breached--> rolled_back (share 0, with the reason)
    holding <--pause / resume--> paused        (paused: watched, never advanced)
    pending|holding|paused --abort--> aborted  (share 0)

Each check compares the two versions' answers to requests for the alias since the step
began: the counters now (`Counters`, from the gateways' /metrics, summed per gateway)
minus the step's baseline (the counters when the step began, kept in the Rollout, so a
pool manager restart resumes the step where it was). A gateway's counter that went down
restarted: its value now is all of the step's. The bounds are hpcserve.config's
RolloutConfig: error rate, truncation rate, JSON validity, TTFT p95.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from hpcserve.config import RolloutConfig

PENDING, HOLDING, PAUSED = "pending", "holding", "paused"
COMPLETED, ROLLED_BACK, ABORTED = "completed", "rolled_back", "aborted"
ACTIVE = (PENDING, HOLDING, PAUSED)
STATES = (*ACTIVE, COMPLETED, ROLLED_BACK, ABORTED)

# What the gateways count (gateway/metrics.py, gateway/quality.py), by the rollout's names.
FAMILIES = {
    "hpcserve_gateway_deployment_answers_total": "answers",
    "hpcserve_gateway_deployment_errors_total": "errors",
    "hpcserve_gateway_deployment_truncations_total": "truncations",
    "hpcserve_gateway_deployment_structured_total": "structured",
    "hpcserve_gateway_deployment_structured_invalid_total": "structured_invalid",
    "hpcserve_gateway_deployment_ttft_seconds_bucket": "ttft",
}
# Counters: "source|name|version|le" -> value (le only for ttft buckets), where source names
# the gateway the value came from and name is one of FAMILIES' values.
Counters = Mapping[str, float]


def counter_key(source: str, name: str, version: str, le: str = "") -> str:
    return f"{source}|{name}|{version}|{le}"


class Rollout(msgspec.Struct, frozen=True):
    alias: str
    ref: str  # the new version, name@version
    stable: str  # the alias's target when the rollout started
    steps: list[int]
    every_s: float
    state: str = PENDING
    step: int = -1  # index in steps of the share in force; -1: none yet
    step_since: float = 0.0  # when the step began (or the hold restarted after a resume)
    baseline: dict[str, float] | None = None  # the counters when the step began
    reason: str = ""  # why the last change
    forced: str = ""  # --force --reason: started although REF has not passed its gate
    started: float = 0.0
    updated: float = 0.0
    note: str = ""  # the last check's verdict while holding (not a change)

    @property
    def share(self) -> int:
        if self.state == COMPLETED:
            return 100
        if self.state in (ROLLED_BACK, ABORTED) or self.step < 0:
            return 0
        return self.steps[self.step]

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


class Stats(msgspec.Struct, frozen=True):
    """One version's answers in a window."""

    answers: float = 0.0
    errors: float = 0.0
    truncations: float = 0.0
    structured: float = 0.0
    structured_invalid: float = 0.0
    ttft: tuple[tuple[float, float], ...] = ()  # (upper bound, count in window), rising

    def ttft_count(self) -> float:
        return self.ttft[-1][1] if self.ttft else 0.0

    def ttft_p95(self) -> float | None:
        return quantile(0.95, self.ttft)


class Change(msgspec.Struct, frozen=True):
    """Route `share`% of the alias to the rollout's REF (100: REF becomes the target; 0:
    the canary is dropped)."""

    share: int


class Decision(msgspec.Struct, frozen=True):
    rollout: Rollout
    change: Change | None = None
    log: str = ""  # one line when the state or the step changed


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) buckets."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # in the +Inf bucket: its lower bound, as Prometheus does
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def window(now: Counters, baseline: Counters, version: str) -> Stats:
    """`version`'s counts since `baseline`, summed over the gateways."""
    sums: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for key, value in now.items():
        _source, name, ver, le = key.split("|")
        if ver != version:
            continue
        before = baseline.get(key, 0.0)
        delta = value - before if value >= before else value  # went down: it restarted
        if name == "ttft":
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + delta
        else:
            sums[name] = sums.get(name, 0.0) + delta
    return Stats(
        answers=sums.get("answers", 0.0),
        errors=sums.get("errors", 0.0),
        truncations=sums.get("truncations", 0.0),
        structured=sums.get("structured", 0.0),
        structured_invalid=sums.get("structured_invalid", 0.0),
        ttft=tuple(sorted(buckets.items())),
    )


def breach(new: Stats, stable: Stats, cfg: RolloutConfig) -> str:
    """The first bound the new version is outside of ("" if none), in words."""
    enough = cfg.min_answers
    if new.answers >= enough:
        rates = (
            ("error rate", new.errors, stable.errors, cfg.max_error_rate_increase),
            ("truncation rate", new.truncations, stable.truncations,
             cfg.max_truncation_rate_increase),
        )  # fmt: skip
        for name, count, stable_count, bound in rates:
            rate = count / new.answers
            base = stable_count / stable.answers if stable.answers >= enough else 0.0
            if rate > base + bound:
                return (
                    f"{name} {rate:.1%} over stable {base:.1%} + {bound * 100:g} points "
                    f"({count:g} of {new.answers:g} answers)"
                )
    if new.structured >= cfg.min_structured:
        valid = 1 - new.structured_invalid / new.structured
        base = 1.0
        if stable.structured >= cfg.min_structured:
            base = 1 - stable.structured_invalid / stable.structured
        if valid < base - cfg.max_json_validity_drop:
            return (
                f"JSON validity {valid:.1%} under stable {base:.1%} - "
                f"{cfg.max_json_validity_drop * 100:g} points "
                f"({new.structured_invalid:g} of {new.structured:g} invalid)"
            )
    if new.ttft_count() >= enough and stable.ttft_count() >= enough:
        p95, base_p95 = new.ttft_p95(), stable.ttft_p95()
        if p95 is not None and base_p95 is not None:
            limit = base_p95 * cfg.ttft_p95_ratio + cfg.ttft_p95_slack_s
            if p95 > limit:
                return (
                    f"TTFT p95 {p95:.3f}s over stable {base_p95:.3f}s x {cfg.ttft_p95_ratio:g} "
                    f"+ {cfg.ttft_p95_slack_s:g}s"
                )
    return ""


def decide(r: Rollout, counters: Counters | None, now: float, cfg: RolloutConfig) -> Decision:
    """One check. `counters`: the gateways' counters now; None when they could not be read
    (nothing advances, nothing is judged)."""
    if r.state == PENDING:
        forced = f" (forced: {r.forced})" if r.forced else ""
        return _enter_step(r, 0, counters, now, f"started{forced}")
    if r.state not in (HOLDING, PAUSED):
        return Decision(r)
    if counters is None:
        return Decision(_note(r, "no metrics from the gateways: nothing judged"))
    if r.baseline is None:  # the step began while the metrics could not be read
        return Decision(msgspec.structs.replace(r, baseline=dict(counters), step_since=now))
    new, stable = window(counters, r.baseline, r.ref), window(counters, r.baseline, r.stable)
    why = breach(new, stable, cfg)
    if why:
        done = _changed(r, now, state=ROLLED_BACK, reason=why)
        return Decision(done, Change(0), _line(done, f"rolled back at {r.share}%: {why}"))
    if r.state == PAUSED:
        return Decision(_note(r, f"paused at {r.share}%: {_seen(new, stable)}"))
    held = now - r.step_since
    if held < r.every_s or new.answers < cfg.min_answers:
        wait = (
            f"{held:.0f}s of {r.every_s:g}s"
            if held < r.every_s
            else f"waiting for {cfg.min_answers} answers"
        )
        return Decision(_note(r, f"holding {r.share}% ({wait}): {_seen(new, stable)}"))
    return _enter_step(r, r.step + 1, counters, now, f"held {held:.0f}s: {_seen(new, stable)}")


def _enter_step(r: Rollout, step: int, counters: Counters | None, now: float, why: str) -> Decision:
    share = r.steps[step]
    if share == 100:
        done = _changed(r, now, state=COMPLETED, step=step, reason=why)
        return Decision(done, Change(100), _line(done, f"completed: {r.ref} is the target ({why})"))
    moved = _changed(
        r,
        now,
        state=HOLDING,
        step=step,
        step_since=now,
        baseline=dict(counters) if counters is not None else None,
        reason=why,
    )
    line = _line(moved, f"step {step + 1} of {len(r.steps)} at {share}% ({why})")
    return Decision(moved, Change(share), line)


def pause(r: Rollout, now: float) -> Rollout:
    return _changed(r, now, state=PAUSED, reason="paused by an admin")


def resume(r: Rollout, now: float) -> Rollout:
    """Holding again; the step's hold starts over (its window of answers goes on)."""
    state = HOLDING if r.step >= 0 else PENDING
    return _changed(r, now, state=state, step_since=now, reason="resumed by an admin")


def abort(r: Rollout, now: float, why: str = "aborted by an admin") -> Rollout:
    return _changed(r, now, state=ABORTED, reason=why)


def describe(r: Rollout) -> str:
    """One line: where the rollout stands."""
    where = f"{r.share}%"
    if r.step >= 0 and r.state in ACTIVE:
        where += f" (step {r.step + 1} of {len(r.steps)})"
    text = f"rollout {r.alias}: {r.ref} over {r.stable}, {r.state} at {where}"
    return text + (f": {r.reason}" if r.reason else "")


def _seen(new: Stats, stable: Stats) -> str:
    def one(s: Stats) -> str:
        if not s.answers:
            return "no answers"
        return f"{s.answers:g} answers, {s.errors / s.answers:.1%} errors"

    return f"new {one(new)}; stable {one(stable)}"


def _changed(r: Rollout, now: float, **fields: object) -> Rollout:
    if fields.get("state") in (COMPLETED, ROLLED_BACK, ABORTED):
        fields["baseline"] = None  # nothing is judged any more
    return msgspec.structs.replace(r, updated=now, note="", **fields)


def _note(r: Rollout, note: str) -> Rollout:
    return r if r.note == note else msgspec.structs.replace(r, note=note)


def _line(r: Rollout, what: str) -> str:
    return f"rollout {r.alias} ({r.ref} over {r.stable}): {what}"
