"""The GPU acceptance run's dry mode, as a site runs it: `scripts/gpu-acceptance.sh --cpu`
(`hpcserve doctor --cpu`): every step of the GPU run on vLLM's CPU build, a real engine
behind the real gateway and router, ended by a drain under load. The GPU-only steps (NVML,
TP=2) report "skipped", never ok (docs/gpu-acceptance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.slurm_helpers import wait_for
from tests.processes import processes_mentioning

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# The report's lines (doctor/report.py): "ok   acceptance: serve tp1: gateway -> ...".
LINE = re.compile(r"^(ok  |WARN|FAIL|skip) acceptance: ([^:]+): (.*)$")


def test_the_acceptance_script_passes_on_vllm_cpu_and_says_what_it_skipped(
    tmp_path: Path,
) -> None:
    work = tmp_path / "acceptance"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-acceptance.sh"), "--cpu", "--venv", sys.prefix,
         "--work-dir", str(work), "--timeout", "600"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    steps = {
        m.group(2): (m.group(1).strip(), m.group(3))
        for m in map(LINE.match, proc.stdout.splitlines())
        if m
    }
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-3000:])
    assert [name for name, (status, _) in steps.items() if status == "ok"] == [
        "model", "stack", "serve tp1", "kv events tp1", "drain tp1",
    ], proc.stdout[-4000:]  # fmt: skip
    assert steps["nvml"][0] == "skip" and "no GPU" in steps["nvml"][1]
    assert steps["tp2"][0] == "skip" and "TP=2 needs 2 GPUs" in steps["tp2"][1]
    assert "all finished (finish_reason length)" in steps["drain tp1"][1]
    assert "doctor: 5 ok, 0 warning(s), 2 skipped, 0 failed" in proc.stdout
    # The run stops what it started.
    wait_for("the run's processes to end", lambda: processes_mentioning(str(work)) == [])
