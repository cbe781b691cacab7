"""`hpcserve down` looks for what the stack left behind by what the processes are: its
programs that name the state dir, every process of a session they lead and everything below
them (a renamed vLLM worker names nothing), kills them, names them and exits 1."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcserve.stack import Stack

# A stand-in for an engine's keeper: it names the state dir, leads a session of its own and
# has a child that names nothing of the stack (as vLLM's renamed engine core and workers).
KEEPER = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def test_down_kills_and_names_what_the_stack_left_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "job.log").write_text("")
    keeper = subprocess.Popen([sys.executable, "-c", KEEPER, str(state)], start_new_session=True)
    # Someone reading a log of the stack is not the stack.
    reader = subprocess.Popen(["tail", "-f", str(state / "job.log")])
    try:
        deadline = time.monotonic() + 60
        while not (kids := children(keeper.pid)):
            assert time.monotonic() < deadline, "the stand-in keeper started no child"
            time.sleep(0.02)
        stack = Stack(state)
        assert sorted(stack._leftovers()) == sorted([keeper.pid, *kids])
        assert stack.down() == 1
        assert keeper.wait(60) < 0
        out = capsys.readouterr().out
        assert "2 processes of this stack were left behind; killing them:" in out
        assert f"  {kids[0]}: sleep 300" in out
        assert stack._leftovers() == {}
        assert reader.poll() is None
    finally:
        for proc in (keeper, reader):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
