"""One pool manager per state dir (poolmgr/single.py): a second one is refused, naming the
holder, and the lock is free again once the holder is gone, SIGKILL included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcserve.poolmgr.single import (
    EXIT_HELD,
    PoolMgrLock,
    PoolMgrLockHeld,
    holder_pid,
    lock_path,
    read_holder,
)
from tests.integration.slurm_helpers import wait_for

HOLD = """
import sys, time
from pathlib import Path
from hpcserve.poolmgr.single import PoolMgrLock
PoolMgrLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(state: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    try:
        with pytest.raises(PoolMgrLockHeld) as refused:
            PoolMgrLock(tmp_path).acquire()
        assert f"pid {proc.pid} on " in str(refused.value)
        assert str(lock_path(tmp_path)) in str(refused.value)
        assert read_holder(tmp_path).startswith(f"pid {proc.pid} on ")
        assert lock_path(tmp_path).stat().st_mode & 0o077 == 0
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    # The kernel freed it with the SIGKILLed holder: nothing left to clean up.
    lock = PoolMgrLock(tmp_path)
    lock.acquire()
    assert lock.held and read_holder(tmp_path).startswith(f"pid {os.getpid()} on ")
    lock.release()
    assert not lock.held


def test_holder_pid_names_only_a_live_pool_manager(tmp_path: Path) -> None:
    assert holder_pid(tmp_path) is None  # no lock file
    proc = _holder(tmp_path)  # its command line does not say poolmgr
    try:
        assert holder_pid(tmp_path) is None
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_hpcserve_poolmgr_exits_3_naming_the_running_one(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = tmp_path / "hpcserve.toml"
    config.write_text(
        f'state_dir = "{state}"\n[poolmgr]\nmetrics_port = 0\nlauncher = "local"\npoll_s = 0.2\n'
    )
    cli = [sys.executable, "-m", "hpcserve.cli", "poolmgr", "--config", str(config)]
    first = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for("the first pool manager to hold the lock", lambda: holder_pid(state) == first.pid)
        second = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert second.returncode == EXIT_HELD, second.stderr
        assert f"another pool manager holds {lock_path(state)} (pid {first.pid} on " in (
            second.stderr
        )
        assert first.poll() is None  # the first one runs on, untouched
    finally:
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=60)
    assert first.returncode == 0, out
    assert "pool manager stopped" in out
