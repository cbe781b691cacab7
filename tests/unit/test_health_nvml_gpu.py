"""The real NVML path (nvidia-ml-py against the driver): runs only on a machine with an
NVIDIA GPU; elsewhere it is skipped, saying why. A site runs the same calls with
`hpcserve health check -v` (docs/architecture.md, Health)."""

from __future__ import annotations

import pytest

from hpcserve.cli import main
from hpcserve.health.gpu_checks import GpuChecks, XidWatcher, pci_map, select_gpus
from hpcserve.health.nvml import NvmlUnavailable, open_nvml
from hpcserve.health.policy import Policy


def _real_nvml_or_reason() -> str:
    try:
        nvml = open_nvml("")
    except NvmlUnavailable as err:
        return f"needs an NVIDIA GPU and its driver: {err}"
    count = nvml.nvmlDeviceGetCount()
    nvml.nvmlShutdown()
    return "" if count else "needs an NVIDIA GPU: NVML started but found no device"


NO_GPU = _real_nvml_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(NO_GPU), reason=NO_GPU)]


def test_every_check_runs_on_the_real_gpus() -> None:
    nvml = open_nvml("")
    try:
        gpus = select_gpus(nvml, None)
        assert gpus, "NVML lists the GPUs"
        checks = GpuChecks(nvml, Policy(), expected=len(gpus))
        lines = checks.readings()
        assert len(lines) == len(gpus) and all("error" not in line for line in lines), lines
        findings = checks.run()
        # A healthy machine has no finding that asks to drain it (print what there is).
        assert [f for f in findings if f.action in ("drain", "drain_reset")] == [], findings
        assert len(pci_map(nvml, gpus)) == len(gpus), "every GPU has a PCI bus id"
        watcher = XidWatcher(nvml, Policy(), gpus)
        assert watcher.watched == [g.index for g in gpus]
        assert watcher.wait(0.5) == []
        watcher.close()
    finally:
        nvml.nvmlShutdown()


def test_health_check_command_on_the_real_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "check", "-v", "--xid-window-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu 0 uuid=GPU-") and "healthy" in out.splitlines()[-1]
