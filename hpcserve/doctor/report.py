"""The doctor's output: one line per check (the fix on the same line), a summary, JSON,
and the exit status.

Exit status: 0 when no check failed, 1 when one did, 2 for a config error (cli). A skip
is a check that does not apply on that host (no NVIDIA device there and no pool runs the
GPU engine; nothing configured to check) and does not fail the run; where the config says
GPUs are needed, their absence is a failure, never a skip. A warning names something that
works but deserves a look. `--strict` makes warnings and skips fail the run too, for a
site that wants every check to have run and passed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from hpcserve.doctor.types import CheckResult

STATUSES = ("ok", "warn", "fail", "skip")
_LABEL = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def format_line(result: CheckResult) -> str:
    line = f"{_LABEL[result.status]} {result.host}: {result.check}: {result.detail}"
    if result.fix and result.status in ("fail", "warn"):
        line += f" -- fix: {result.fix}"
    return line


def summary(results: list[CheckResult]) -> dict[str, int]:
    counts: Counter[str] = Counter(r.status for r in results)
    return {status: counts[status] for status in STATUSES}


def exit_status(results: list[CheckResult], *, strict: bool = False) -> int:
    bad = ("fail", "warn", "skip") if strict else ("fail",)
    return 1 if any(r.status in bad for r in results) else 0


def format_report(results: list[CheckResult], *, strict: bool = False) -> str:
    counts = summary(results)
    lines = [format_line(r) for r in results]
    lines.append(
        f"doctor: {counts['ok']} ok, {counts['warn']} warning(s), {counts['skip']} skipped, "
        f"{counts['fail']} failed" + (" (--strict: warnings and skips fail)" if strict else "")
    )
    return "\n".join(lines)


def report_json(results: list[CheckResult], *, strict: bool = False) -> dict[str, Any]:
    return {
        "checks": msgspec.to_builtins(results),
        "summary": summary(results),
        "strict": strict,
        "exit_status": exit_status(results, strict=strict),
    }


def write_metrics(path: str, results: list[CheckResult]) -> None:
    """The results for node_exporter's textfile collector: a site that runs the doctor from
    cron alerts on hpcserve_doctor_failed_checks > 0."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    registry = CollectorRegistry()
    checks = Gauge(
        "hpcserve_doctor_checks",
        "Results of the last `hpcserve doctor` run, by check, host and status",
        ["check", "host", "status"],
        registry=registry,
    )
    for result in results:
        checks.labels(result.check, result.host, result.status).inc()
    failed = Gauge(
        "hpcserve_doctor_failed_checks", "Checks that failed in the last run", registry=registry
    )
    failed.set(summary(results)["fail"])
    write_to_textfile(path, registry)
