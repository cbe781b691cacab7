"""A fake NVML for machines without a GPU: the pynvml calls hpcserve uses, same names,
same arguments, same return shapes and the same `pynvml.NVMLError`s, answered from a JSON
file that is re-read on every call (so a test changes a running job's GPUs by rewriting it).

Selected only explicitly (health.fake_nvml or $HPCSERVE_FAKE_NVML); never a fallback.

    {"gpus": [{"uuid": "GPU-0", "pci": "00000000:3B:00.0", "xids": [79], "lost": false,
               "temperature_c": 45,
               "ecc_uncorrected_volatile": 0, "remapped_rows": {"pending": false,
               "failed": false, "correctable": 0, "uncorrectable": 0},
               "retired_pages_pending": false, "retired_pages": {"sbe": 0, "dbe": 0},
               "clock_event_reasons": 0, "nvlink": [true, true]}]}

`xids` is the GPU's Xid history: like the driver, an event set reports only the Xids
appended after it registered. `lost` makes every call on the GPU fail with GPU_IS_LOST.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass
class FakeEventData:
    """The fields of pynvml.c_nvmlEventData_t."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


@dataclass(frozen=True)
class FakePciInfo:
    busId: str  # as pynvml.c_nvmlPciInfo_t (the field hpcserve reads)


@dataclass
class FakeEventSet:
    seen: dict[int, int]  # GPU index -> Xids already there when it registered
    types: dict[int, int]


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, path: Path, *, poll_s: float = 0.05) -> None:
        self.path = path
        self.poll_s = poll_s
        self._initialised = False

    # -- the file
    def _state(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise _error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED) from None
        except (OSError, ValueError) as err:
            raise RuntimeError(f"fake NVML state {self.path}: {err}") from None
        if not isinstance(data, dict) or not isinstance(data.get("gpus", []), list):
            raise RuntimeError(f"fake NVML state {self.path}: expected {{'gpus': [...]}}")
        return data

    def _gpu(self, handle: FakeHandle) -> dict[str, Any]:
        if not self._initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        gpus = self._state().get("gpus", [])
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = gpus[handle.index]
        if gpu.get("lost"):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    # -- library
    def nvmlInit(self) -> None:
        self._state()
        self._initialised = True

    def nvmlShutdown(self) -> None:
        self._initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._state().get("driver", "fake"))

    # -- devices
    def nvmlDeviceGetCount(self) -> int:
        if not self._initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self._state().get("gpus", []))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if not 0 <= index < self.nvmlDeviceGetCount():
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._gpu(handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return str(self._gpu(handle).get("uuid", f"GPU-fake-{handle.index}"))

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> FakePciInfo:
        bus = self._gpu(handle).get("pci", f"00000000:{handle.index + 1:02x}:00.0")
        return FakePciInfo(busId=str(bus))

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return str(self._gpu(handle).get("name", "Fake GPU"))

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(self._gpu(handle).get("temperature_c", 40))

    def nvmlDeviceGetTotalEccErrors(
        self, handle: FakeHandle, error_type: int, counter_type: int
    ) -> int:
        gpu = self._gpu(handle)
        if "ecc_uncorrected_volatile" not in gpu and gpu.get("ecc") is False:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        kind = (
            "uncorrected"
            if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            else ("corrected")
        )
        period = "volatile" if counter_type == pynvml.NVML_VOLATILE_ECC else "aggregate"
        return int(gpu.get(f"ecc_{kind}_{period}", 0))

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        rows = self._gpu(handle).get("remapped_rows")
        if rows is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (
            int(rows.get("correctable", 0)),
            int(rows.get("uncorrectable", 0)),
            int(bool(rows.get("pending", False))),
            int(bool(rows.get("failed", False))),
        )

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeHandle) -> int:
        gpu = self._gpu(handle)
        if "retired_pages_pending" not in gpu:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(bool(gpu["retired_pages_pending"]))

    def nvmlDeviceGetRetiredPages(self, handle: FakeHandle, cause: int) -> list[int]:
        pages = self._gpu(handle).get("retired_pages")
        if pages is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        key = "dbe" if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else "sbe"
        return [0x1000 * i for i in range(int(pages.get(key, 0)))]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return int(self._gpu(handle).get("clock_event_reasons", 0))

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        links = self._gpu(handle).get("nvlink", [])
        if not 0 <= link < len(links):
            raise _error(
                pynvml.NVML_ERROR_NOT_SUPPORTED
                if not links
                else (pynvml.NVML_ERROR_INVALID_ARGUMENT)
            )
        return pynvml.NVML_FEATURE_ENABLED if links[link] else pynvml.NVML_FEATURE_DISABLED

    # -- events
    def nvmlEventSetCreate(self) -> FakeEventSet:
        if not self._initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        return FakeEventSet(seen={}, types={})

    def nvmlDeviceRegisterEvents(
        self, handle: FakeHandle, event_types: int, event_set: FakeEventSet
    ) -> None:
        gpu = self._gpu(handle)
        event_set.seen[handle.index] = len(gpu.get("xids", []))
        event_set.types[handle.index] = event_types

    def nvmlEventSetWait_v2(self, event_set: FakeEventSet, timeout_ms: int) -> FakeEventData:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            gpus = self._state().get("gpus", [])
            for index, seen in event_set.seen.items():
                if not event_set.types[index] & pynvml.nvmlEventTypeXidCriticalError:
                    continue
                xids = gpus[index].get("xids", []) if index < len(gpus) else []
                if len(xids) > seen:
                    event_set.seen[index] = seen + 1
                    return FakeEventData(
                        device=FakeHandle(index),
                        eventType=pynvml.nvmlEventTypeXidCriticalError,
                        eventData=int(xids[seen]),
                    )
            if time.monotonic() >= deadline:
                raise _error(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0)))

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        event_set.seen.clear()
