"""What the registry keeps of model onboarding (`hpcserve models eval`, the parity gate, gated
promotion): an evaluation per run, the gate rule per model, and an audit line per traffic
move. The tables sit beside the registry's own (registry.py creates them if absent, so an
older registry file gains them on first open without a schema change).
"""

from __future__ import annotations

import msgspec

DEFAULT_MAX_DROP = 1.0  # points a key metric may fall below the baseline's

TABLES = """
CREATE TABLE IF NOT EXISTS evaluations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    passed INTEGER NOT NULL,
    record TEXT NOT NULL,
    created REAL NOT NULL,
    FOREIGN KEY (model, version) REFERENCES versions(model, version) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS evaluations_by_version ON evaluations (model, version, id);
CREATE TABLE IF NOT EXISTS gate_rules (
    model TEXT PRIMARY KEY,
    max_drop REAL NOT NULL CHECK (max_drop >= 0),
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    action TEXT NOT NULL,
    subject TEXT NOT NULL,
    ref TEXT NOT NULL,
    forced INTEGER NOT NULL,
    reason TEXT NOT NULL,
    actor TEXT NOT NULL,
    detail TEXT NOT NULL
)
"""


class MetricResult(msgspec.Struct, frozen=True):
    """One key metric through the gate (points, 0-100)."""

    metric: str
    score: float
    baseline: float | None = None
    delta: float | None = None  # score - baseline
    floor: float | None = None  # the suite's min_scores entry
    passed: bool = True


class Benchmark(msgspec.Struct, frozen=True, kw_only=True):
    """A short load run of the version through the gateway (bench/workload.py)."""

    workload: str  # the stated workload: name, requests, rate, lengths, seed
    requests: int
    ok: int
    duration_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    output_tokens_per_s: float
    requests_per_s: float


class Evaluation(msgspec.Struct, frozen=True, kw_only=True):
    """One run of a suite against a version, compared with a baseline version's run."""

    ref: str  # name@version evaluated
    suite: str
    suite_digest: str  # sha256 of the suite file
    suite_path: str
    cases: int
    scores: dict[str, float]  # every metric of the suite, in points
    key_metrics: list[str]
    passed: bool
    results: list[MetricResult] = []  # the key metrics through the gate
    reasons: list[str] = []  # why it failed
    baseline: str = ""  # name@version compared with; "": none (floors only)
    baseline_scores: dict[str, float] = {}
    baseline_engine_version: str = ""
    max_drop: float = DEFAULT_MAX_DROP
    errors: int = 0  # cases whose request failed (their checks score 0)
    engine_version: str = ""
    engine_args: list[str] = []
    served_by: str = ""  # the served model name and job that answered
    benchmark: Benchmark | None = None
    at: float = 0.0
    actor: str = ""
    id: int = 0  # the registry's row id (0 before it is recorded)
    # The golden record (numerical canaries) once the gate passed: recorded where, kept, or
    # why not; "" in evaluations made before the eval recorded canaries.
    canary: str = ""

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"


class GateRule(msgspec.Struct, frozen=True):
    model: str
    max_drop: float = DEFAULT_MAX_DROP
    updated: float = 0.0  # 0: the default, never set


class AuditEntry(msgspec.Struct, frozen=True):
    """A traffic move (`alias`, `promote`) or a gate change, as done and by whom."""

    id: int
    at: float
    action: str  # "alias", "promote", "gate"
    subject: str  # the alias (or model, for "gate")
    ref: str
    forced: bool
    reason: str
    actor: str
    detail: str  # "gate passed: evaluation 4 (bol-extraction vs docs@1)", "share 10%"

    def line(self) -> str:
        forced = f" FORCED ({self.reason})" if self.forced else ""
        return f"{self.action} {self.subject} -> {self.ref}: {self.detail}{forced} by {self.actor}"
