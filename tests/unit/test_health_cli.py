"""`hpcserve health check`: one line per finding, a summary line, the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcserve.cli import main
from tests.unit.test_health_engine_checks import Engine


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = main(["health", "check", "--xid-window-s", "0.1", *args])
    return code, capsys.readouterr().out.splitlines()


def state(tmp_path: Path, gpus: list[dict[str, object]]) -> str:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"gpus": gpus}))
    return str(path)


def test_healthy_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run(capsys, "--node", "n1", "--fake-nvml", state(tmp_path, [{}, {}]))
    assert code == 0
    assert len(lines) == 1 and lines[0].startswith("node n1: healthy (")


def test_findings_one_line_each_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpus = [{"temperature_c": 95}, {"remapped_rows": {"pending": True}}, {"lost": True}]
    code, lines = run(
        capsys, "--node", "n1", "--expect-gpus", "4", "--fake-nvml", state(tmp_path, gpus)
    )
    assert code == 1
    assert lines[:-1] == [
        "drain gpu_count: gpu count 3 of 4",
        "log temperature: temperature 95C gpu 0",
        "drain remap_pending: row remap pending gpu 1 (0 uncorrectable rows)",
        "drain gpu_lost: gpu 2 lost (GPU is lost)",
    ]
    assert lines[-1].startswith("node n1: 4 finding(s), worst: drain (")


def test_log_only_findings_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "health.prom"
    code, lines = run(
        capsys,
        "--node", "n1", "--fake-nvml", state(tmp_path, [{"temperature_c": 95}]),
        "--metrics-file", str(metrics),
    )  # fmt: skip
    assert code == 0 and lines[0] == "log temperature: temperature 95C gpu 0"
    assert (
        'hpcserve_health_check_findings_total{action="log",check="temperature"} 1.0'
        in metrics.read_text()
    )


def test_verbose_prints_nvml_readings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run(capsys, "-v", "--node", "n1", "--fake-nvml", state(tmp_path, [{}]))
    assert code == 0
    assert lines[0].startswith("gpu 0 uuid=GPU-fake-0 name=Fake GPU temp_c=40 ")


def test_no_nvml_on_a_node_without_gpus_is_not_a_finding(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, lines = run(capsys, "--node", "n1", "--fake-nvml", str(tmp_path / "none.json"))
    assert code == 0 and lines[0].startswith("no GPU checks: cannot initialise the fake NVML")
    code, lines = run(
        capsys, "--node", "n1", "--expect-gpus", "2", "--fake-nvml", str(tmp_path / "none.json")
    )
    assert code == 1 and lines[0].startswith("drain nvml_error: nvml unavailable: ")


def test_engine_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = Engine()
    try:
        gpus = state(tmp_path, [{}])

        def args(probe_deadline_s: int) -> tuple[str, ...]:
            config = tmp_path / f"hpcserve-{probe_deadline_s}.toml"
            config.write_text(f"[health]\nprobe_deadline_s = {probe_deadline_s}\n")
            return ("--config", str(config), "--node", "n1", "--fake-nvml", gpus,
                    "--engine-url", engine.url, "--model", "m")  # fmt: skip

        # The engine (a thread here) answers within a deadline no descheduling reaches...
        assert run(capsys, *args(60))[0] == 0
        engine.answering.clear()  # ...or not until the probe has given up
        code, lines = run(capsys, *args(1))
        assert code == 1
        assert lines[0] == "stop_routing engine_probe: engine probe: no answer within 1s"
        engine.answering.set()
        engine.serves = set()
        code, lines = run(capsys, *args(60))
        assert code == 0 and lines[0].startswith("engine probe: cannot probe: engine refused")
    finally:
        engine.server.shutdown()
        engine.server.server_close()


def test_bad_config_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[health]\nxid_actions = {x = 'drain'}\n")
    assert main(["health", "check", "--config", str(path)]) == 2
    assert "health.xid_actions: key 'x' is not an Xid number" in capsys.readouterr().err
