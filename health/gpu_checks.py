"""GPU checks through NVML (pynvml calls, real or fake): one pass over the GPUs' state, and
a watcher that waits for Xid events.

A pass reads, per GPU: volatile uncorrectable ECC errors, row remapping (pending, failed),
pending page retirement, temperature, clock-event (throttle) reasons and NVLink states; a
call answered NOT_SUPPORTED is skipped (not every GPU has every counter), GPU_IS_LOST or
RESET_REQUIRED makes the GPU lost, any other error is an nvml_error finding. Xids arrive
only as events (NVML keeps no history), so a one-shot check also listens for a moment; a
GPU that fell off the bus (Xid 79) shows as lost anyway.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import pynvml

from hpcserve.contracts.protocol import HealthFinding
from hpcserve.health.policy import Policy

log = logging.getLogger(__name__)

_SKIP = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION)
_LOST = (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED)
_THERMAL = (
    pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonSwThermalSlowdown
)
_POWER = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown


@dataclass(frozen=True)
class Gpu:
    index: int
    handle: Any


def parse_visible_devices(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of indices or UUIDs; None when unset (all GPUs)."""
    if value is None or value.strip() in ("", "all"):
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def select_gpus(nvml: Any, visible: list[str] | None) -> list[Gpu]:
    count = nvml.nvmlDeviceGetCount()
    gpus = [Gpu(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    if visible is None:
        return gpus
    chosen = []
    for item in visible:
        for gpu in gpus:
            if item == str(gpu.index) or _uuid(nvml, gpu) == item:
                chosen.append(gpu)
                break
    return chosen


def pci_map(nvml: Any, gpus: list[Gpu]) -> dict[str, int]:
    """Normalised PCI bus id ("0000:3b:00") -> GPU index, for Xids from the kernel log."""
    from hpcserve.health.kernel_xids import normalise_pci

    found = {}
    for gpu in gpus:
        try:
            bus = nvml.nvmlDeviceGetPciInfo(gpu.handle).busId
        except pynvml.NVMLError:
            continue
        found[normalise_pci(bus.decode() if isinstance(bus, bytes) else str(bus))] = gpu.index
    return found


def _uuid(nvml: Any, gpu: Gpu) -> str:
    try:
        return str(nvml.nvmlDeviceGetUUID(gpu.handle))
    except pynvml.NVMLError:
        return ""


class _Lost(Exception):
    pass


class GpuChecks:
    """One pass over the GPUs' state -> findings. `expected`: GPUs Slurm allocated (0: any)."""

    def __init__(
        self,
        nvml: Any,
        policy: Policy,
        *,
        expected: int = 0,
        visible: list[str] | None = None,
    ) -> None:
        self.nvml = nvml
        self.policy = policy
        self.expected = expected
        self.visible = visible

    def run(self) -> list[HealthFinding]:
        try:
            gpus = select_gpus(self.nvml, self.visible)
        except pynvml.NVMLError as err:
            return [self.policy.finding("nvml_error", f"nvml cannot list GPUs: {err}")]
        findings = []
        wanted = len(self.visible) if self.visible is not None else self.expected
        if wanted and len(gpus) < wanted:
            findings.append(self.policy.finding("gpu_count", f"gpu count {len(gpus)} of {wanted}"))
        for gpu in gpus:
            try:
                findings += self._check(gpu)
            except _Lost as lost:
                findings.append(
                    self.policy.finding("gpu_lost", f"gpu {gpu.index} lost ({lost})", gpu=gpu.index)
                )
        return findings

    def _call(self, gpu: Gpu, name: str, *args: Any) -> Any:
        """The pynvml call's value; None when the GPU does not support it."""
        try:
            return getattr(self.nvml, name)(gpu.handle, *args)
        except pynvml.NVMLError as err:
            if err.value in _SKIP:
                return None
            if err.value in _LOST:
                raise _Lost(str(err)) from None
            raise

    def _check(self, gpu: Gpu) -> list[HealthFinding]:
        try:
            return self._readings(gpu)
        except pynvml.NVMLError as err:
            return [
                self.policy.finding(
                    "nvml_error", f"nvml error gpu {gpu.index}: {err}", gpu=gpu.index
                )
            ]

    def _readings(self, gpu: Gpu) -> list[HealthFinding]:
        out: list[HealthFinding] = []
        i = gpu.index

        def add(check: str, detail: str) -> None:
            out.append(self.policy.finding(check, detail, gpu=i))

        ecc = self._call(
            gpu,
            "nvmlDeviceGetTotalEccErrors",
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
        if ecc:
            add("ecc_uncorrectable", f"ecc uncorrectable {ecc} gpu {i}")
        rows = self._call(gpu, "nvmlDeviceGetRemappedRows")
        if rows is not None:
            _corr, unc, pending, failed = rows
            if failed:
                add("remap_failed", f"row remap failed gpu {i}")
            elif pending:
                add("remap_pending", f"row remap pending gpu {i} ({unc} uncorrectable rows)")
        if self._call(gpu, "nvmlDeviceGetRetiredPagesPendingStatus"):
            add("retired_pages_pending", f"page retirement pending gpu {i}")
        temp = self._call(gpu, "nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU)
        if temp is not None and temp >= self.policy.config.max_temperature_c:
            add("temperature", f"temperature {temp}C gpu {i}")
        reasons = self._call(gpu, "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons:
            if reasons & _THERMAL:
                add("thermal_throttle", f"thermal slowdown gpu {i}")
            if reasons & _POWER:
                add("power_throttle", f"power brake slowdown gpu {i}")
        down = self._nvlinks_down(gpu)
        if down:
            add("nvlink_down", f"nvlink {','.join(map(str, down))} down gpu {i}")
        return out

    def _nvlinks_down(self, gpu: Gpu) -> list[int]:
        states = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                states.append(self.nvml.nvmlDeviceGetNvLinkState(gpu.handle, link))
            except pynvml.NVMLError as err:
                if err.value in _LOST:
                    raise _Lost(str(err)) from None
                break  # NOT_SUPPORTED / INVALID_ARGUMENT: no such link
        # Only a GPU that has NVLink at all (some link up) can have a link down.
        if not any(s == pynvml.NVML_FEATURE_ENABLED for s in states):
            return []
        return [n for n, s in enumerate(states) if s != pynvml.NVML_FEATURE_ENABLED]

    def readings(self) -> list[str]:
        """One line per GPU with what NVML reads (for `health check --verbose`)."""
        lines = []
        for gpu in select_gpus(self.nvml, self.visible):
            parts = [f"gpu {gpu.index}"]
            for label, name, args in (
                ("uuid", "nvmlDeviceGetUUID", ()),
                ("name", "nvmlDeviceGetName", ()),
                ("temp_c", "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,)),
                (
                    "ecc_unc_volatile",
                    "nvmlDeviceGetTotalEccErrors",
                    (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
                ),
                ("remapped_rows", "nvmlDeviceGetRemappedRows", ()),
                ("clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", ()),
            ):
                try:
                    value = self._call(gpu, name, *args)
                except (_Lost, pynvml.NVMLError) as err:
                    value = f"error: {err}"
                parts.append(f"{label}={'n/a' if value is None else value}")
            try:
                links = len(self._nvlinks_up(gpu))
            except (_Lost, pynvml.NVMLError) as err:
                links = f"error: {err}"  # type: ignore[assignment]
            parts.append(f"nvlinks_up={links}")
            lines.append(" ".join(parts))
        return lines

    def _nvlinks_up(self, gpu: Gpu) -> list[int]:
        up = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if self.nvml.nvmlDeviceGetNvLinkState(gpu.handle, link):
                    up.append(link)
            except pynvml.NVMLError:
                break
        return up


class XidWatcher:
    """Waits for Xid events on the given GPUs (NVML reports those after registration)."""

    def __init__(self, nvml: Any, policy: Policy, gpus: list[Gpu]) -> None:
        self.nvml = nvml
        self.policy = policy
        self._set = nvml.nvmlEventSetCreate()
        self.watched: list[int] = []
        for gpu in gpus:
            try:
                nvml.nvmlDeviceRegisterEvents(
                    gpu.handle, pynvml.nvmlEventTypeXidCriticalError, self._set
                )
                self.watched.append(gpu.index)
            except pynvml.NVMLError as err:
                log.warning("gpu %d: cannot watch Xid events: %s", gpu.index, err)

    def wait(self, timeout_s: float) -> list[HealthFinding]:
        """Xid findings that arrive within timeout_s (returns at the first, plus any queued)."""
        findings = []
        timeout_ms = max(int(timeout_s * 1000), 0)
        while self.watched:
            try:
                event = self.nvml.nvmlEventSetWait_v2(self._set, timeout_ms)
            except pynvml.NVMLError as err:
                if err.value == pynvml.NVML_ERROR_TIMEOUT:
                    break
                if err.value in _LOST:
                    findings.append(self.policy.finding("gpu_lost", f"gpu lost ({err})"))
                else:
                    findings.append(self.policy.finding("nvml_error", f"nvml event wait: {err}"))
                break
            if event.eventType & pynvml.nvmlEventTypeXidCriticalError:
                try:
                    index = int(self.nvml.nvmlDeviceGetIndex(event.device))
                except pynvml.NVMLError:
                    index = -1
                findings.append(self.policy.xid_finding(int(event.eventData), index))
            timeout_ms = 0
        return findings

    def close(self) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            self.nvml.nvmlEventSetFree(self._set)
