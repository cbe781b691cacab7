"""Each GPU check and the Xid watcher, through the fake NVML (the pynvml calls hpcserve
uses, answered from a JSON file)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from hpcserve.health.fake_nvml import FakeNvml
from hpcserve.health.gpu_checks import GpuChecks, XidWatcher, parse_visible_devices, select_gpus
from hpcserve.health.nvml import NvmlUnavailable, fake_state_path, open_nvml
from hpcserve.health.policy import Policy


def write_state(path: Path, gpus: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "nvml.json"
    write_state(path, [{} for _ in range(4)])
    return path


def check(state: Path, gpus: list[dict[str, Any]], **kwargs: Any) -> list[tuple[str, str, str]]:
    write_state(state, gpus)
    nvml = open_nvml(str(state))
    found = GpuChecks(nvml, Policy(), **kwargs).run()
    return [(f.check, f.detail, f.action) for f in found]


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ({}, []),
        ({"ecc_uncorrected_volatile": 2}, [("ecc_uncorrectable", "ecc uncorrectable 2 gpu 1", "drain")]),
        ({"ecc_uncorrected_aggregate": 7}, []),  # history, not a live fault
        ({"remapped_rows": {"pending": True, "uncorrectable": 1}},
         [("remap_pending", "row remap pending gpu 1 (1 uncorrectable rows)", "drain")]),
        ({"remapped_rows": {"failed": True, "pending": True}},
         [("remap_failed", "row remap failed gpu 1", "drain")]),
        ({"remapped_rows": {"correctable": 3}}, []),
        ({"retired_pages_pending": True}, [("retired_pages_pending", "page retirement pending gpu 1", "drain")]),
        ({"temperature_c": 89}, []),
        ({"temperature_c": 91}, [("temperature", "temperature 91C gpu 1", "log")]),
        ({"clock_event_reasons": pynvml.nvmlClocksEventReasonHwThermalSlowdown},
         [("thermal_throttle", "thermal slowdown gpu 1", "log")]),
        ({"clock_event_reasons": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown},
         [("power_throttle", "power brake slowdown gpu 1", "log")]),
        ({"clock_event_reasons": pynvml.nvmlClocksEventReasonSwPowerCap}, []),  # normal under load
        ({"nvlink": [True, True, False, True]}, [("nvlink_down", "nvlink 2 down gpu 1", "drain")]),
        ({"nvlink": [False, False]}, []),  # no NVLink in use at all
        ({"lost": True}, [("gpu_lost", "gpu 1 lost (GPU is lost)", "drain")]),
    ],
)  # fmt: skip
def test_each_check(state: Path, gpu: dict[str, Any], expected: list[tuple[str, str, str]]) -> None:
    assert check(state, [{}, gpu, {}]) == expected


def test_gpu_count_against_the_allocation(state: Path) -> None:
    assert check(state, [{}, {}, {}], expected=4) == [("gpu_count", "gpu count 3 of 4", "drain")]
    assert check(state, [{}, {}, {}, {}], expected=4) == []
    assert check(state, [{}, {}], expected=0) == []
    # The job's GPUs by CUDA_VISIBLE_DEVICES (indices or UUIDs): only those are checked.
    gpus = [{"uuid": f"GPU-{i}"} for i in range(4)]
    gpus[0]["temperature_c"] = 99
    assert check(state, gpus, visible=["GPU-2", "3"]) == []
    assert check(state, gpus, visible=["0", "GPU-9"]) == [
        ("gpu_count", "gpu count 1 of 2", "drain"),
        ("temperature", "temperature 99C gpu 0", "log"),
    ]


def test_visible_devices_parsing() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") is None
    assert parse_visible_devices("all") is None
    assert parse_visible_devices("0, 2") == ["0", "2"]
    assert parse_visible_devices("GPU-ab,GPU-cd") == ["GPU-ab", "GPU-cd"]


def test_xid_events_arrive_only_after_registration(state: Path) -> None:
    write_state(state, [{"xids": [79]}, {}, {}, {}])  # history before the watcher started
    nvml = open_nvml(str(state))
    watcher = XidWatcher(nvml, Policy(), select_gpus(nvml, None))
    assert watcher.watched == [0, 1, 2, 3]
    assert watcher.wait(0.1) == []

    def inject() -> None:
        time.sleep(0.2)
        write_state(state, [{"xids": [79]}, {}, {}, {"xids": [13, 79]}])

    thread = threading.Thread(target=inject)
    thread.start()
    started = time.monotonic()
    found = watcher.wait(60)
    thread.join()
    assert time.monotonic() - started < 30, "returns as soon as an event arrives"
    found += watcher.wait(0.2)
    assert [(f.detail, f.action, f.gpu) for f in found] == [
        ("xid 13 gpu 3 (application error)", "log", 3),
        ("xid 79 gpu 3", "drain", 3),
    ]
    assert watcher.wait(0.1) == [], "each event once"
    watcher.close()


def test_the_fake_answers_like_pynvml(state: Path) -> None:
    fake = FakeNvml(state)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(4)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetRemappedRows(handle)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(fake.nvmlEventSetCreate(), 10)
    assert fake.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU) == 40
    write_state(state, [{"retired_pages": {"dbe": 2, "sbe": 1}}])
    pages = fake.nvmlDeviceGetRetiredPages(
        handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    )
    assert len(pages) == 2
    fake.nvmlShutdown()


def test_the_fake_is_only_chosen_explicitly(tmp_path: Path) -> None:
    assert fake_state_path("", env={}) == ""
    assert fake_state_path("/x/{node}.json", env={}, node="n1") == "/x/n1.json"
    assert fake_state_path("/cfg.json", env={"HPCSERVE_FAKE_NVML": "/env.json"}) == "/env.json"
    # A named state file that does not exist is a missing driver, not a silent healthy GPU.
    with pytest.raises(NvmlUnavailable, match=r"fake NVML .*Driver Not Loaded"):
        open_nvml(str(tmp_path / "missing.json"))


def test_nvml_errors_become_findings(state: Path) -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    nvml = Broken(state)
    nvml.nvmlInit()
    found = GpuChecks(nvml, Policy()).run()
    assert {(f.check, f.action) for f in found} == {("nvml_error", "drain")}
    assert found[0].detail == "nvml error gpu 0: Unknown Error"
