"""`hpcserve up --launcher local` (a machine without Slurm): the same engine job script runs
as a local process; the CLI commands work as a user runs them; `down` leaves nothing behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcserve.config import PoolConfig, dump_config
from tests.processes import processes_mentioning, session_processes
from tests.services import stack_config

pytestmark = pytest.mark.vllm

KEY = "sk-local-test"


def hpcserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_up_local_serves_then_down_stops_everything(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    pool = PoolConfig(
        name="tiny-chat",
        model_path=str(state / "models" / "tiny-chat"),
        engine="vllm-cpu",
        engine_args=["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"],
    )
    # `up` starts `hpcserve batch-runner` too (on a free port).
    config = stack_config(state, api_keys={"t": KEY}, pools=[pool], launcher="local", drain_s=15)
    (state / "hpcserve.toml").write_text(dump_config(config))
    (state / "demo-api-key").write_text(KEY + "\n")
    try:
        up = hpcserve(
            "up", "--state-dir", str(state), "--launcher", "local", "--timeout", "420", timeout=500
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert "making the tiny demo model" in up.stdout
        assert "replica registered" in up.stdout
        assert "started batch-runner" in up.stdout
        assert "reply from tiny-chat" in up.stdout and "finish_reason=length" in up.stdout
        assert f"curl -s http://127.0.0.1:{config.gateway.port}/v1/chat/completions" in up.stdout

        status = hpcserve("status", "--json", "--config", str(state / "hpcserve.toml"))
        replicas = json.loads(status.stdout)["replicas"]
        assert [(r["model"], r["pool"], r["job_id"]) for r in replicas] == [
            ("tiny-chat", "tiny-chat", 1)
        ]  # the local launcher's job number

        again = hpcserve("up", "--state-dir", str(state), "--launcher", "local", timeout=120)
        assert again.returncode == 0 and "router already running" in again.stdout
    finally:
        down = hpcserve("down", "--state-dir", str(state), timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert processes_mentioning(str(state)) == []  # vLLM's API server has --model <state>/...
    (log,) = (state / "jobs").glob("*.out")
    text = log.read_text()
    assert "engine stopped (vLLM exit code 0)" in text
    # vLLM drained, and nothing of its tree is left: found by session, process group and
    # parentage, as its engine core and workers rename themselves (VLLM::...).
    (pid,) = re.findall(r"draining vLLM \(pid (\d+)\)", text)
    assert not Path(f"/proc/{pid}").exists()
    (session,) = re.findall(r"starting vLLM in session (\d+)", text)
    assert session_processes(int(session)) == []
    assert "vLLM stopped: drained in " in text
    port = re.findall(r"--port (\d+)", text)[0]
    assert processes_mentioning(f"--port {port}") == []
