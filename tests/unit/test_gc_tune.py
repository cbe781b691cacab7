"""The gateway process's collector settings (gateway/gc_tune.py), in a fresh interpreter
(they are process-wide: the test process keeps its own)."""

from __future__ import annotations

import subprocess
import sys

from hpcserve.gateway.gc_tune import GEN0_THRESHOLD


def test_tune_gc_freezes_the_start_up_objects_and_raises_the_young_threshold() -> None:
    code = (
        "import gc; before = gc.get_threshold()\n"
        "from hpcserve.gateway.gc_tune import tune_gc\n"
        "tune_gc()\n"
        "print(before[1:] == gc.get_threshold()[1:], gc.get_threshold()[0], "
        "gc.get_freeze_count() > 1000, gc.isenabled())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["True", str(GEN0_THRESHOLD), "True", "True"]
