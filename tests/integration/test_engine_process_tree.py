"""`hpcserve engine` owns real vLLM's whole process tree (engine_launch/process_tree.py):
stopped while it loads, killed hard, or hung in its drain, vLLM leaves no process behind.

vLLM (CPU build) does not act on SIGTERM while it loads, and its engine core and worker
rename themselves (VLLM::...) and blank their environment: every check here of what is
left is by session, process group and parentage, over a full scan of /proc, never by name.
To stop vLLM mid-load these engines run without --enforce-eager: after the worker starts,
torch.compile keeps it loading for a minute, so "loading" is a state, not a race.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from hpcserve.config import Launcher, PlatformConfig, PoolConfig, dump_config
from hpcserve.contracts.router_client import list_replicas
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from hpcserve.stack import Stack
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import free_port_block, wait_for
from tests.processes import job_cgroup_processes, session_processes
from tests.services import stack_config

pytestmark = pytest.mark.vllm

# vLLM's API server, its engine core and its worker: all started, none serving yet.
LOADING = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("chat", tmp_path_factory.mktemp("model") / "tiny-chat")


def start_engine(
    router: RouterServer, model: Path, log_path: Path, *, eager: bool
) -> subprocess.Popen[bytes]:
    eager_args = ["--enforce-eager"] if eager else []
    with log_path.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "vllm-cpu",
             "--model-path", str(model), "--served-model-name", "tiny", "--pool", "pt",
             "--router", router.config.registry_bind, "--bind-host", "127.0.0.1",
             "--advertise-host", "127.0.0.1", "--heartbeat-s", "0.25", "--drain-s", "1",
             "--", "--dtype", "float32", "--max-model-len", "512", *eager_args],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )  # fmt: skip


def session_from_log(log_path: Path) -> int:
    found = wait_for(
        "vLLM started",
        lambda: re.findall(r"starting vLLM in session (\d+)", log_path.read_text()),
        timeout=300,
    )
    return int(found[0])


def wait_loading(session: int, engine: subprocess.Popen[bytes], log_path: Path) -> list[str]:
    """Until vLLM's engine core and worker run (its processes, by session)."""
    wait_for(
        "vLLM's engine core and worker",
        lambda: len(session_processes(session)) >= LOADING or engine.poll() is not None,
        timeout=600,
    )
    assert engine.poll() is None, log_path.read_text()[-3000:]
    assert "vLLM ready" not in log_path.read_text(), "vLLM was to be still loading"
    return session_processes(session)


def pid_live(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def ppid(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def assert_nothing_left(session: int, members: list[str]) -> None:
    """No process of the session, its process group or below its keeper (a full scan of
    /proc), none of the processes seen while it ran, and not the keeper itself."""
    wait_for("vLLM's whole tree gone", lambda: session_processes(session) == [], timeout=120)
    pids = [int(line.split()[0]) for line in members]
    assert [pid for pid in pids if pid_live(pid)] == []
    wait_for("the keeper gone", lambda: not pid_live(session), timeout=60)


def stopped_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if "vLLM stopped: " in line]
    return line


@pytest.fixture
def log_path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "engine.log"


def _end(engine: subprocess.Popen[bytes]) -> None:
    if engine.poll() is None:
        engine.kill()
    engine.wait(60)


def test_sigterm_while_vllm_loads_stops_its_whole_tree_at_once(
    router: RouterServer, model: Path, log_path: Path
) -> None:
    engine = start_engine(router, model, log_path, eager=False)
    try:
        session = session_from_log(log_path)
        members = wait_loading(session, engine, log_path)
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(120) == 0
    finally:
        _end(engine)
    assert_nothing_left(session, members)
    line = stopped_line(log_path.read_text())
    assert "not serving yet, nothing to drain" in line, line
    assert f"its process tree (session {session}): pids " in line
    assert "draining" not in log_path.read_text()


def test_the_engine_killed_while_vllm_loads_takes_the_tree_with_it(
    router: RouterServer, model: Path, log_path: Path
) -> None:
    engine = start_engine(router, model, log_path, eager=False)
    try:
        session = session_from_log(log_path)
        members = wait_loading(session, engine, log_path)
        engine.kill()
        assert engine.wait(60) == -signal.SIGKILL
    finally:
        _end(engine)
    assert_nothing_left(session, members)
    text = log_path.read_text()
    assert f"the engine (pid {engine.pid}) is gone: vLLM's process tree (session {session}" in (
        text
    )


def test_a_drain_that_does_not_end_kills_the_tree(
    router: RouterServer, model: Path, log_path: Path
) -> None:
    engine = start_engine(router, model, log_path, eager=True)
    routing = router.config.routing_bind
    api = 0
    try:
        session = session_from_log(log_path)
        wait_for("vLLM to register", lambda: list_replicas(routing) or engine.poll(), 600)
        assert engine.poll() is None, log_path.read_text()[-3000:]
        members = session_processes(session)
        # vLLM's API server: the keeper's child (the keeper is the session's leader)
        (api,) = [int(line.split()[0]) for line in members if ppid(line.split()[0]) == session]
        os.kill(api, signal.SIGSTOP)  # a hung API server: the drain cannot end
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(180) == 0
    finally:
        if api and pid_live(api):
            os.kill(api, signal.SIGCONT)
        _end(engine)
    assert_nothing_left(session, members)
    text = log_path.read_text()
    assert f"draining vLLM (pid {api}) for up to 1s" in text
    line = stopped_line(text)
    assert "killed (SIGKILL): the drain did not end within 16s" in line, line
    assert f"its process tree (session {session}): pids " in line


# `hpcserve up`, then the job cancelled or `hpcserve down` (`make down`) while vLLM loads.


def loading_stack_config(state: Path, model: Path, launcher: Launcher) -> PlatformConfig:
    """A stack whose one pool's vLLM takes long to load (torch.compile)."""
    shutil.copytree(model, state / "models" / "pt")
    pool = PoolConfig(
        name="pt",
        model_path=str(state / "models" / "pt"),
        engine="vllm-cpu",
        # no --enforce-eager: torch.compile keeps vLLM loading for a minute
        engine_args=["--dtype", "float32", "--max-model-len", "512"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    config = stack_config(
        state, api_keys={"t": "sk-tree-test"}, pools=[pool], launcher=launcher, drain_s=15
    )
    return msgspec.structs.replace(
        config,
        slurm=msgspec.structs.replace(config.slurm, time_limit_min=30),
        poolmgr=msgspec.structs.replace(config.poolmgr, min_submit_interval_s=0.5),
    )


def loading_job(
    state: Path, glob: str, other_than: Path | None = None
) -> tuple[Path, int, list[str]]:
    """The job log whose engine started vLLM, vLLM's session, its processes once loading."""

    def started() -> Path | None:
        logs = [p for p in sorted((state / "jobs").glob(glob)) if p != other_than]
        return next((p for p in logs if "starting vLLM" in p.read_text()), None)

    log = wait_for("a job's engine to start vLLM", started, timeout=300)
    (session,) = map(int, re.findall(r"starting vLLM in session (\d+)", log.read_text()))
    wait_for(
        "vLLM's engine core and worker",
        lambda: len(session_processes(session)) >= LOADING,
        timeout=600,
    )
    assert "vLLM ready" not in log.read_text(), "vLLM was to be still loading"
    return log, session, session_processes(session)


def test_down_while_vllm_loads_leaves_nothing_with_the_local_launcher(
    tmp_path: Path, model: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "hpcserve.toml").write_text(dump_config(loading_stack_config(state, model, "local")))
    stack = Stack(state)
    try:
        assert stack.up(launcher="local", timeout_s=1) == 1  # not ready: vLLM loads
        log, session, members = loading_job(state, "*-local1.out")
        assert stack.down() == 0
    finally:
        stack.down()
    assert_nothing_left(session, members)
    assert stack._leftovers() == {}
    line = stopped_line(log.read_text())
    assert "not serving yet, nothing to drain" in line, line


@pytest.mark.slurm
def test_a_cancelled_job_and_down_while_vllm_loads_leave_nothing_under_slurm(
    short_state_dir: Path, model: Path
) -> None:
    state = short_state_dir
    state.mkdir()
    config = loading_stack_config(state, model, "slurm")
    (state / "hpcserve.toml").write_text(dump_config(config))
    stack = Stack(state, slurm_port=free_port_block())
    slurm = SlurmCLI({**os.environ, "SLURM_CONF": config.slurm.conf}, timeout_s=10)
    try:
        assert stack.up(launcher="slurm", timeout_s=1) == 1  # not ready: vLLM loads
        # A plain scancel: Slurm signals every process of the job, then kills what is left.
        log, session, members = loading_job(state, "*.out")
        job = int(log.stem.rsplit("-", 1)[1])
        slurm.cancel([job])
        wait_for(
            "the job to end",
            lambda: (
                not any(j.job_id == job and j.state.is_active for j in slurm.jobs().jobs) or None
            ),
            timeout=120,
        )
        assert_nothing_left(session, members)
        assert job_cgroup_processes(job) == []
        # The pool manager replaces it; `down` while the new one loads.
        log2, session2, members2 = loading_job(state, "*.out", other_than=log)
        job2 = int(log2.stem.rsplit("-", 1)[1])
        assert stack.down() == 0
    finally:
        stack.down()
    assert_nothing_left(session2, members2)
    assert job_cgroup_processes(job2) == []
    assert stack._leftovers() == {}
    line = stopped_line(log2.read_text())
    assert "not serving yet, nothing to drain" in line, line
