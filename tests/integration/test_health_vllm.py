"""The engine checks against real vLLM (CPU build): vLLM's API server keeps answering
/health while its engine core is stopped, so only a real generation catches it.

One vLLM for both cases: SIGSTOP the engine core (the replica leaves routing; /health still
200), SIGCONT (it rejoins after a clean probe), then SIGKILL the engine core (it leaves, and
the engine exits 1 so Slurm would record a failed job).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from hpcserve.contracts.router_client import list_replicas
from hpcserve.router.server import RouterServer
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import wait_for

pytestmark = pytest.mark.vllm


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists() and cmdline(p)]


def health_status(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
        return resp.status


def test_stopped_then_killed_engine_core_leaves_routing(
    router: RouterServer, tmp_path: Path
) -> None:
    model = make_tiny_model("chat", tmp_path / "tiny-chat")
    health = {"probe_interval_s": 1, "probe_deadline_s": 5, "stall_s": 10, "give_up_s": 600}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HPCSERVE_HEALTH": json.dumps(health)}
    log_path = tmp_path / "engine.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "vllm-cpu",
             "--model-path", str(model), "--served-model-name", "tiny", "--pool", "hv",
             "--router", router.config.registry_bind, "--bind-host", "127.0.0.1",
             "--advertise-host", "127.0.0.1", "--heartbeat-s", "0.25", "--drain-s", "5",
             "--", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    routing = router.config.routing_bind
    family: list[int] = []
    core = 0
    try:
        wait_for("vLLM to register", lambda: list_replicas(routing) or proc.poll(), timeout=600)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        (replica,) = list_replicas(routing)
        family = descendants(proc.pid)
        core = next(p for p in family if "VLLM::EngineCore" in cmdline(p))

        os.kill(core, signal.SIGSTOP)
        wait_for("the stopped core out of routing", lambda: not list_replicas(routing), timeout=60)
        assert health_status(replica.url) == 200, "the API server still says healthy"

        os.kill(core, signal.SIGCONT)
        wait_for("back in routing", lambda: len(list_replicas(routing)) == 1, timeout=120)

        os.kill(core, signal.SIGKILL)
        wait_for("the killed core out of routing", lambda: not list_replicas(routing), timeout=60)
        assert proc.wait(120) == 1
        text = log_path.read_text()
        assert "health: engine probe: no answer within 5s (check engine_probe" in text
        assert "leaves routing until its checks pass" in text
        assert "passes its checks again: rejoining" in text
        assert "while serving" in text  # vLLM exited: the engine failed
    finally:
        if core and alive([core]):
            os.kill(core, signal.SIGCONT)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        wait_for("vLLM's processes gone", lambda: not alive(family), timeout=60)
