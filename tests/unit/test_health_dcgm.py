"""DCGM's text tables -> findings. The outputs follow the layout DCGM's documentation shows
for `dcgmi health -c` and `dcgmi diag -r 1` (no DCGM here to record one from)."""

from __future__ import annotations

import subprocess

from hpcserve.health.dcgm import dcgm_findings, parse_dcgmi_diag, parse_dcgmi_health
from hpcserve.health.policy import Policy

HEALTH = """\
Health Monitor Report
+----------------------------------------------------------------------------+
| Overall Health: Failure                                                    |
+==================+=========================================================+
| GPU ID: 0        | Warning                                                 |
|                  | PCIe system: Warning - Detected more than 8 PCIe        |
|                  | replays per minute for GPU 0: 13                        |
+------------------+---------------------------------------------------------+
| GPU ID: 1        | Healthy                                                 |
+------------------+---------------------------------------------------------+
| GPU ID: 2        | Failure                                                 |
|                  | Memory system: Failure - A volatile double-bit ECC      |
|                  | error occurred on GPU 2                                 |
|                  | NVLink system: Warning - link 4 down                    |
+------------------+---------------------------------------------------------+
"""

DIAG = """\
Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Metadata  ----------+------------------------------------------------|
| DCGM Version              | 3.3.5                                          |
|-----  Deployment  --------+------------------------------------------------|
| Denylist                  | Pass                                           |
| NVML Library              | Pass                                           |
| Persistence Mode          | Warn                                           |
| Warning                   | Persistence mode for GPU 0 is disabled.        |
| Page Retirement/Row Remap | Fail                                           |
| Warning                   | GPU 2 has uncorrectable memory errors and row  |
|                           | remappings are pending.                        |
| Graphics Processes        | Skip                                           |
+---------------------------+------------------------------------------------+
"""


def test_parse_health() -> None:
    gpus = parse_dcgmi_health(HEALTH)
    assert [(g.gpu, g.status) for g in gpus] == [(0, "Warning"), (1, "Healthy"), (2, "Failure")]
    assert gpus[0].details == [
        "PCIe system: Warning - Detected more than 8 PCIe replays per minute for GPU 0: 13"
    ]
    assert gpus[2].details == [
        "Memory system: Failure - A volatile double-bit ECC error occurred on GPU 2",
        "NVLink system: Warning - link 4 down",
    ]
    assert parse_dcgmi_health("") == []


def test_parse_diag() -> None:
    results = {r.test: r for r in parse_dcgmi_diag(DIAG)}
    assert {t: r.result for t, r in results.items()} == {
        "Denylist": "Pass",
        "NVML Library": "Pass",
        "Persistence Mode": "Warn",
        "Page Retirement/Row Remap": "Fail",
        "Graphics Processes": "Skip",
    }
    assert results["Page Retirement/Row Remap"].details == [
        "GPU 2 has uncorrectable memory errors and row remappings are pending."
    ]


def test_findings_from_dcgmi() -> None:
    outputs = {"health": HEALTH, "diag": DIAG}

    def runner(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, outputs[argv[1]], "")

    found = dcgm_findings(Policy(), diag=True, runner=runner)
    assert [(f.check, f.action, f.gpu) for f in found] == [
        ("dcgm_warning", "log", 0),
        ("dcgm_failure", "drain", 2),
        ("dcgm_warning", "log", -1),
        ("dcgm_failure", "drain", -1),
    ]
    assert found[3].detail.startswith("dcgm diag Page Retirement/Row Remap: GPU 2 has")
    assert len(dcgm_findings(Policy(), runner=runner)) == 2, "diag only on request"
