"""vLLM's process tree, owned by the engine (engine_launch/process_tree.py), with a stand-in
for vLLM: a shell that, like vLLM loading its model, ignores SIGTERM, and whose children
do what vLLM's may: stay in the session, leave it (setsid), or lose their parent.

Every check of what is left is by what the processes are (session, process group,
parentage: a full scan of /proc), never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcserve.engine_launch.process_tree import VllmTree, process_table, tree_members
from tests.processes import session_processes

# "Loading": SIGTERM ignored (its children inherit that); one child in the session, one in
# a session of its own, one orphaned (its parent exits at once); then it waits.
LOADING = """
trap '' TERM
sleep 300 &
setsid sleep 300 &
( sleep 300 & )
wait
"""
# "Serving": exits 0 on SIGTERM, leaving its child (which got no signal) behind.
SERVING = "trap 'exit 0' TERM; sleep 300 & wait"


def wait_until(what: str, predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    proc = process_table().get(pid)
    return proc is not None and proc.live


def test_terminate_kills_a_tree_that_ignores_sigterm() -> None:
    tree = VllmTree(["bash", "-c", LOADING], dict(os.environ))
    try:
        wait_until("the whole stand-in tree", lambda: len(tree.members()) >= 4)
        pids = tree.members()
        table = process_table()
        assert table[tree.pid].sid == tree.session and table[tree.pid].pgid == tree.session
        assert any(table[p].sid == p for p in pids), "one child left the session (setsid)"
        assert tree.poll() is None
        how = tree.terminate(grace_s=1)
        assert how == "killed (SIGTERM, then SIGKILL after 1s)"
        assert tree.close() == []
    finally:
        tree.close()
    assert tree.returncode == -signal.SIGKILL
    assert not any(alive(p) for p in pids)
    assert session_processes(tree.session) == []


def test_sigterm_reaches_the_api_server_alone_and_close_kills_what_it_left() -> None:
    tree = VllmTree(["bash", "-c", SERVING], dict(os.environ))
    try:
        wait_until("the API server and its child", lambda: len(tree.members()) == 2)
        (child,) = [p for p in tree.members() if p != tree.pid]
        tree.signal_api(signal.SIGTERM)
        assert tree.wait(60) == 0
        assert alive(child), "the API server's child got no SIGTERM"
        assert tree.close(grace_s=0.5) == [child]
    finally:
        tree.close()
    assert session_processes(tree.session) == []


def test_the_exit_code_of_a_vllm_that_exits_on_its_own() -> None:
    tree = VllmTree(["bash", "-c", "exit 3"], dict(os.environ))
    try:
        assert tree.wait(60) == 3
    finally:
        assert tree.close() == []
    missing = VllmTree(["/nonexistent/vllm"], dict(os.environ))
    try:
        assert missing.wait(60) == 127
    finally:
        missing.close()


def test_the_engine_killed_hard_takes_the_tree_with_it(tmp_path: Path) -> None:
    """SIGKILL of the engine: the keeper sees its lifeline close and ends the tree."""
    engine_code = (
        "import os, sys, time\n"
        "from hpcserve.engine_launch.process_tree import VllmTree\n"
        f"tree = VllmTree(['bash', '-c', {LOADING!r}], dict(os.environ), grace_s=1)\n"
        "print(tree.session, flush=True)\n"
        "time.sleep(600)\n"
    )
    log = tmp_path / "engine.log"
    with log.open("w") as err:
        engine = subprocess.Popen(
            [sys.executable, "-c", engine_code], stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        assert engine.stdout is not None
        session = int(engine.stdout.readline())
        wait_until("the stand-in tree", lambda: len(tree_members(session)) >= 4)
        pids = tree_members(session)
        engine.kill()
        assert engine.wait(60) == -signal.SIGKILL
        wait_until("the tree gone", lambda: session_processes(session) == [], 120)
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.wait()
        if engine.stdout is not None:
            engine.stdout.close()
    assert not any(alive(p) for p in pids)
    wait_until("the keeper's line", lambda: "is gone" in log.read_text())
    (line,) = [x for x in log.read_text().splitlines() if "is gone" in x]
    assert f"the engine (pid {engine.pid}) is gone: vLLM's process tree (session {session}" in line
    assert "killed (SIGTERM, then SIGKILL after 1s" in line
