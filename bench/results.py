"""Where a benchmark's figures go: bench/results/NAME.json, with one meta block for all.

    from bench.results import write_results
    write_results("router_quality-64", {"rows": rows}, {"replicas": 64})

writes ``{"meta": {...}, "rows": [...]}``: the meta block says when (``date``, UTC), where
(``machine``: cores, CPU model, memory, Python), how to run it again (``command``, from the
repository root) and how busy the machine was (``load_average``: 1, 5 and 15 minutes, when
the file is written), plus the benchmark's own ``extra_meta`` (its sizes, a load average
taken before the run...), which may also override those four.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
# Set by bench/suite.py for the benchmarks it runs: their bounded runs go there, beside and
# not over the full runs docs/benchmarks.md discusses.
RESULTS_DIR_ENV = "HPCSERVE_BENCH_RESULTS_DIR"


def machine() -> str:
    """``2 cores AMD EPYC 7B13, 8 GiB, Python 3.11.7``."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    return f"{os.cpu_count()} cores {cpu}{mem}, Python {platform.python_version()}"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def command(argv: list[str] | None = None) -> str:
    """The command line that ran this script, runnable from the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return shlex.join([".venv/bin/python", str(script), *argv[1:]])


def meta(extra_meta: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "command": command(),
        "load_average": load_average(),
        **(extra_meta or {}),
    }


def write_results(
    name: str,
    results: dict[str, Any],
    extra_meta: dict[str, Any] | None = None,
    *,
    directory: Path | None = None,
) -> Path:
    """Write ``{"meta": ..., **results}`` to ``directory/NAME.json`` (default
    bench/results/; $HPCSERVE_BENCH_RESULTS_DIR, when set, wins); returns the path."""
    if "meta" in results:
        raise ValueError(f"results for {name!r}: 'meta' is written by write_results")
    override = os.environ.get(RESULTS_DIR_ENV)
    out = (Path(override) if override else directory or RESULTS_DIR) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta(extra_meta), **results}, indent=2) + "\n")
    return out
