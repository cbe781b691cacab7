"""A simulated engine's staging and load time (`--sim-load-s`), for rehearsals and
benchmarks of cold starts (bench/autoscale_day.py): a real replica holds its GPUs for
minutes (staging the weights, vLLM's load and warm-up) before it serves; the simulated one
starts in a second or two unless told to wait.

`--sim-load-s LO[,HI]` draws the time uniformly from LO to HI seconds (LO alone: exactly
LO) and the engine serves (binds its port, so the engine agent sees it ready and registers
it) only that long after its job started: the start of the process that started it (the
engine agent, which the job script starts first), so the agent's and the simulator's own
start-up are inside the drawn time rather than added to it (a draw shorter than them is
late by the difference). `--sim-load-seed N` makes the draw repeatable: it is seeded by N
and the job's id (SLURM_JOB_ID, which the local launcher sets to its job number), so the
n-th job of two runs loads alike; without it the draw is unseeded.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path


class LoadSpecError(ValueError):
    pass


def parse_load_s(text: str) -> tuple[float, float]:
    """`LO[,HI]` -> (lo, hi) seconds; LoadSpecError naming the flag when malformed."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise LoadSpecError(f"--sim-load-s: expected LO[,HI] in seconds, got {text!r}") from None
    if len(parts) == 1:
        parts.append(parts[0])
    if len(parts) != 2 or parts[0] < 0 or parts[1] < parts[0]:
        raise LoadSpecError(f"--sim-load-s: expected 0 <= LO <= HI, got {text!r}")
    return parts[0], parts[1]


def draw_load_s(lo: float, hi: float, seed: int | None, job_id: str) -> float:
    """The staging + load time of job `job_id`: uniform in [lo, hi]; repeatable per seed
    and job id when a seed is given."""
    rng = random.Random(f"{seed}:{job_id}") if seed is not None else random.Random()
    return rng.uniform(lo, hi)


def process_start(pid: int) -> float | None:
    """When process `pid` started (epoch seconds, to 10 ms), from /proc; None where
    unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        # The fields after the command name (which may hold spaces) start at state (field
        # 3); starttime is field 22, in clock ticks after boot.
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def wait_loaded(spec: str, seed: int | None) -> float:
    """Sleep until the drawn load time has passed since the job started (the parent's start,
    else this process's); returns the drawn time."""
    lo, hi = parse_load_s(spec)
    drawn = draw_load_s(lo, hi, seed, os.environ.get("SLURM_JOB_ID", ""))
    started = process_start(os.getppid()) or process_start(os.getpid()) or time.time()
    time.sleep(max(started + drawn - time.time(), 0.0))
    return drawn
