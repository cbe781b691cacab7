"""DCGM, where it is installed: `dcgmi health -c` (the health watches' verdict per GPU) and,
on request, `dcgmi diag -r 1` (the quick diagnostic, seconds to a minute). Pure parsers of
dcgmi's text tables, and a runner that turns them into findings. Optional: without dcgmi
on PATH nothing runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from hpcserve.contracts.protocol import HealthFinding
from hpcserve.health.policy import Policy

Runner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


@dataclass
class GpuHealth:
    gpu: int
    status: str  # Healthy | Warning | Failure
    details: list[str] = field(default_factory=list)


def _cells(line: str) -> list[str] | None:
    line = line.strip()
    if not (line.startswith("|") and line.endswith("|")) or line.startswith("|-"):
        return None
    return [c.strip() for c in line[1:-1].split("|")]


def parse_dcgmi_health(text: str) -> list[GpuHealth]:
    """The per-GPU rows of `dcgmi health -c`; continuation rows are joined to their GPU."""
    gpus: list[GpuHealth] = []
    for line in text.splitlines():
        cells = _cells(line)
        if not cells or len(cells) < 2:
            continue
        left, right = cells[0], " ".join(cells[1:]).strip()
        match = re.fullmatch(r"GPU ID:\s*(\d+)", left)
        if match:
            gpus.append(GpuHealth(int(match.group(1)), right.split(" ")[0] if right else ""))
        elif not left and right and gpus:
            details = gpus[-1].details
            # A detail wraps over rows; a new one starts with "<system>: <Status>".
            if details and not re.match(r"^[\w /]+: (Warning|Failure|Healthy)\b", right):
                details[-1] += " " + right
            else:
                details.append(right)
    return gpus


@dataclass
class DiagResult:
    test: str
    result: str  # Pass | Fail | Warn | Skip
    details: list[str] = field(default_factory=list)


def parse_dcgmi_diag(text: str) -> list[DiagResult]:
    """The test rows of `dcgmi diag -r N` (Pass/Fail/Warn/Skip), with their Warning/Info rows."""
    results: list[DiagResult] = []
    for line in text.splitlines():
        cells = _cells(line)
        if not cells or len(cells) != 2:
            continue
        left, right = cells
        word = right.split(" ")[0] if right else ""
        if left in ("Warning", "Error", "Info") and results:
            results[-1].details.append(right)
        elif word in ("Pass", "Fail", "Warn", "Skip") and left:
            results.append(DiagResult(left, word))
        elif not left and right and results and results[-1].details:
            results[-1].details[-1] += " " + right
    return results


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def dcgm_findings(
    policy: Policy, *, diag: bool = False, runner: Runner = _run, timeout_s: float = 50.0
) -> list[HealthFinding]:
    """Findings from dcgmi; [] when dcgmi is not installed."""
    if runner is _run and shutil.which("dcgmi") is None:
        return []
    findings: list[HealthFinding] = []
    argv = ["dcgmi", "health", "-c"]
    try:
        res = runner(argv, timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [policy.finding("dcgm_warning", f"dcgmi health did not run: {err}")]
    for gpu in parse_dcgmi_health(res.stdout):
        what = "; ".join(gpu.details) or gpu.status
        if gpu.status == "Failure":
            findings.append(
                policy.finding("dcgm_failure", f"dcgm gpu {gpu.gpu}: {what}", gpu=gpu.gpu)
            )
        elif gpu.status == "Warning":
            findings.append(
                policy.finding("dcgm_warning", f"dcgm gpu {gpu.gpu}: {what}", gpu=gpu.gpu)
            )
    if diag:
        try:
            res = runner(["dcgmi", "diag", "-r", "1"], timeout_s)
        except (OSError, subprocess.TimeoutExpired) as err:
            return [*findings, policy.finding("dcgm_warning", f"dcgmi diag did not run: {err}")]
        for test in parse_dcgmi_diag(res.stdout):
            what = f"dcgm diag {test.test}: " + ("; ".join(test.details) or test.result)
            if test.result == "Fail":
                findings.append(policy.finding("dcgm_failure", what))
            elif test.result == "Warn":
                findings.append(policy.finding("dcgm_warning", what))
    return findings
