"""Numerical canaries of one replica (contracts/canary.py): the check the engine runs before
it registers, and the periodic one of the health monitor beside it.

The golden record reaches the job as a file (`--canary-record`, `$HPCSERVE_CANARY_RECORD`)
that the pool manager keeps in step with the registry (poolmgr/canary_records.py); it may
appear, change or go while the replica serves. `CanaryWatch` stats it on every check round
of the monitor, checks at once when a record appears or changes, and then every
`health.canary_interval_s`. A mismatch is a finding ("numerical canary mismatch at position
P (prompt I): ...", check `numerical_canary`, action from the policy: stop_routing by
default) that stays in every round until a later canary matches again, so the replica does
not rejoin on a round that ran no canary; out of routing for `health.give_up_s`, the engine
gives up and the job is replaced. A canary that cannot run (no answer in time) changes
nothing: the generation probe reports an engine that does not answer.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from hpcserve.contracts.canary import CanaryError, GoldenRecord, Mismatch
from hpcserve.contracts.canary_client import CanaryRunError, check_replica, load_record
from hpcserve.contracts.protocol import HealthFinding
from hpcserve.health.policy import Policy

log = logging.getLogger(__name__)

CHECK = "numerical_canary"
RECORD_ENV = "HPCSERVE_CANARY_RECORD"  # the golden record's file (a path; set by the pool manager)

Checker = Callable[..., Mismatch | None]


@dataclass(frozen=True)
class CanaryOutcome:
    result: str  # "pass", "mismatch" or "error"
    detail: str = ""  # the mismatch's finding detail, or why it could not run


def run_canary(
    record: GoldenRecord,
    engine_url: str,
    model: str,
    *,
    engine_token: str = "",
    deadline_s: float = 60.0,
    checker: Checker = check_replica,
) -> CanaryOutcome:
    """Decode the record's canaries on the engine and compare (never raises for the engine)."""
    try:
        mismatch = checker(
            engine_url, model, record, engine_token=engine_token, deadline_s=deadline_s
        )
    except (CanaryRunError, CanaryError) as err:
        return CanaryOutcome("error", str(err))
    if mismatch is not None:
        return CanaryOutcome("mismatch", mismatch.detail())
    return CanaryOutcome("pass")


class CanaryWatch:
    """The periodic canary of one replica (see the module's docstring); the monitor's check
    thread calls `round()` once per check round, and reads `outcomes` for the router."""

    def __init__(
        self,
        path: str,
        *,
        engine_url: str,
        model: str,
        model_ref: str,
        policy: Policy,
        interval_s: float,
        deadline_s: float,
        engine_token: str = "",
        clock: Callable[[], float] = time.monotonic,
        checker: Checker = check_replica,
    ) -> None:
        self.path = path
        self.engine_url = engine_url
        self.model = model
        self.model_ref = model_ref
        self.policy = policy
        self.interval_s = interval_s
        self.deadline_s = deadline_s
        self._token = engine_token
        self._clock = clock
        self._checker = checker
        self.record: GoldenRecord | None = None
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the file read
        self._next = clock() + interval_s  # the engine checked before it registered
        self.finding: HealthFinding | None = None
        self.last_result = ""

    def round(self) -> tuple[list[HealthFinding], CanaryOutcome | None]:
        """This round's canary finding (the last mismatch, until a canary matches again) and
        the outcome of a canary run this round, if one ran."""
        now = self._clock()
        changed = self._reload()
        outcome = None
        if self.record is not None and (changed or now >= self._next):
            self._next = now + self.interval_s
            outcome = self._check(self.record)
        return ([self.finding] if self.finding is not None else []), outcome

    def _reload(self) -> bool:
        """Read the record file when it appeared or changed; True when it did."""
        try:
            st = os.stat(self.path)
        except OSError:
            if self.record is not None:
                log.info("health: the golden record %s is gone: no numerical canary", self.path)
                self.record, self._stamp, self.finding = None, None, None
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            record = load_record(self.path)
        except CanaryError as err:
            log.error("health: %s; the numerical canary keeps the last good record", err)
            return False
        if record is None:
            return False
        if self.model_ref and record.model_ref != self.model_ref:
            log.error(
                "health: %s is the golden record of %s, this replica serves %s: not used",
                self.path,
                record.model_ref,
                self.model_ref,
            )
            return False
        log.info(
            "health: numerical canary against the golden record of %s (%s), every %gs",
            record.model_ref,
            self.path,
            self.interval_s,
        )
        self.record = record
        return True

    def _check(self, record: GoldenRecord) -> CanaryOutcome:
        outcome = run_canary(
            record,
            self.engine_url,
            self.model,
            engine_token=self._token,
            deadline_s=self.deadline_s,
            checker=self._checker,
        )
        if outcome.result == "mismatch":
            self.finding = self.policy.finding(CHECK, outcome.detail)
        elif outcome.result == "pass":
            if self.finding is not None or self.last_result != "pass":
                log.info(
                    "health: numerical canary matches the golden record of %s", record.model_ref
                )
            self.finding = None
        else:
            log.warning("health: numerical canary could not run: %s", outcome.detail)
        self.last_result = outcome.result
        return outcome
