"""A pytest plugin that stalls asyncio event loops, as a loaded CI machine does when it
deschedules the test process between two loop iterations: timers fall due together with the
I/O they were meant to wait for. A test that fails under it races a deadline against work on
the same loop (make the deadline unreachable, or wait for the condition).

    PYTHONPATH=. LOOPSTALL_P=0.02 .venv/bin/pytest -p tests.stall.loopstall tests/unit/x.py

LOOPSTALL_P: chance that a loop iteration stalls first; LOOPSTALL_S: the stall's range in
seconds; LOOPSTALL_SEED: repeat a run. Threads of the process (a router served from a thread)
run on meanwhile; tests/stall/pauser.py stops the whole process instead.
"""

from __future__ import annotations

import asyncio.base_events
import os
import random
import time
from typing import Any

_CHANCE = float(os.environ.get("LOOPSTALL_P", "0.02"))
_LOW, _HIGH = (float(x) for x in os.environ.get("LOOPSTALL_S", "0.3,2.4").split(","))
_rng = random.Random(int(os.environ.get("LOOPSTALL_SEED", "0")) or None)
_stalls = [0, 0.0]  # how many, seconds in all
_run_once = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]


def _stalling_run_once(self: Any) -> None:
    if _rng.random() < _CHANCE:
        seconds = _rng.uniform(_LOW, _HIGH)
        time.sleep(seconds)
        _stalls[0] += 1
        _stalls[1] += seconds
    _run_once(self)


asyncio.base_events.BaseEventLoop._run_once = _stalling_run_once  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"loopstall: {_stalls[0]} stalls, {_stalls[1]:.1f} s in all")
