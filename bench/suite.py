"""`make bench`: every registered benchmark, bounded, into docs/benchmarks.md with plots.

Each entry of ``BENCHMARKS`` is run as its own process with the (short) arguments given
there and a timeout; the suite then reads the JSON the benchmark wrote and rewrites that
benchmark's block in docs/benchmarks.md (between ``<!-- suite:NAME -->`` and
``<!-- /suite:NAME -->`` in the "Suite run" section, so hand-written analysis above is kept):
the command that reproduces it, the machine, the date, the run's wall time, the table, and
a PNG plot under docs/img/ when the entry declares one. The figures are the benchmarks' own
medians over their repeats; the suite adds no timing of its own.

Registering a benchmark: add one ``Benchmark(...)`` to ``BENCHMARKS`` below, nothing else.

- ``command``: the script and its arguments, sized so the run fits its ``timeout_s``;
- ``result``: the JSON file it writes (the suite has it written under bench/results/suite/,
  through $HPCSERVE_BENCH_RESULTS_DIR, beside the full runs in bench/results/);
- the table is taken from the JSON's ``rows`` (a list of flat objects) when it has them,
  else from the markdown table the script prints, else from the JSON's top-level numbers;
- ``plot``: optionally ``Plot(x=..., y=[...])`` over ``rows`` (bars, or lines when x is
  numeric);
- ``in_default=False``: too slow for ``make bench``; runs only with ``--only NAME``;
- ``needs``: what must be present (``root`` for a local Slurm cluster, a program name,
  ``python:PKG``), else the benchmark is reported as skipped with the reason.

Budget: a benchmark whose timeout would end past ``BUDGET_S`` (10 minutes) from the
suite's start is skipped and reported so; order the list by importance.

    .venv/bin/python bench/suite.py                 # everything (make bench)
    .venv/bin/python bench/suite.py --only simfleet,router_cost
    .venv/bin/python bench/suite.py --list
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import RESULTS_DIR_ENV, machine  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
# Not bench/results/ itself: that holds the full runs docs/benchmarks.md discusses, which a
# bounded run must not overwrite.
RESULTS = ROOT / "bench" / "results" / "suite"
SECTION = "## Suite run (`make bench`)"
BUDGET_S = 600


@dataclass(frozen=True)
class Plot:
    x: str
    y: list[str]
    ylabel: str = ""
    logx: bool = False
    logy: bool = False
    group: str = ""  # a column whose values become separate series (e.g. "target")


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    command: str  # the script and its arguments, run with the venv's python from the root
    result: str
    timeout_s: int = 120
    plot: Plot | None = None
    needs: list[str] = field(default_factory=list)
    table: Callable[[dict[str, Any]], str] | None = None
    # False: too slow for `make bench`; runs only when named with --only.
    in_default: bool = True

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command)


# The suite, in run order. One entry per benchmark; keep the total under BUDGET_S here.
BENCHMARKS: list[Benchmark] = [
    Benchmark(
        "simfleet",
        "Simulated fleet: 64 replicas start, register and serve through the gateway",
        "bench/simfleet.py --replicas 64 --repeats 3 --requests 200 --rate 10",
        "simfleet.json",
        timeout_s=150,
    ),
    Benchmark(
        "proxy_overhead",
        "Gateway overhead, feature by feature (plain relay, + auth, quotas, routing, metrics, "
        "audit, prefix hints, the router in the gateway)",
        "bench/proxy_overhead.py --rounds 1 --seconds 2 --cases chat,chat1,stream1 "
        "--only relay,auth,quotas,routing,metrics,audit,hints,embedded",
        "proxy_overhead.json",
        timeout_s=180,
        needs=["wrk"],
        plot=Plot(x="case", y=["p50_ms"], group="target", ylabel="p50 latency (ms)", logy=True),
    ),
    Benchmark(
        "gateway_instructions",
        "Gateway instructions per request (callgrind) against the plain relay",
        "bench/gateway_instructions.py --requests 100 --rounds 1",
        "gateway_instructions.json",
        timeout_s=300,
        needs=["valgrind", "nginx"],
        in_default=False,  # ~2 min of valgrind; for an A/B of two commits, see its --baseline
    ),
    Benchmark(
        "router_quality",
        "Routing quality on the simulated fleet (kv-aware, least-load, round-robin)",
        "bench/router_quality.py --replicas 8 --requests 60 --rate 6 "
        "--workloads doc-extraction,multi-turn",
        "router_quality.json",
        timeout_s=180,
    ),
    Benchmark(
        "router_cost",
        "Router cost: decision latency, KV-event ingest, memory per block",
        "bench/router_cost.py --replicas 200 --blocks 100000 --decisions 5000 --rounds 3",
        "router_cost.json",
        timeout_s=90,
    ),
    Benchmark(
        "poolmgr_reconcile",
        "Pool manager: one reconcile pass over N Slurm jobs",
        "bench/poolmgr_reconcile.py --sizes 10,100,1000 --passes 3",
        "poolmgr_reconcile.json",
        timeout_s=150,
        needs=["root", "slurmctld"],
        plot=Plot(x="jobs", y=["cpu_ms", "wall_ms"], ylabel="ms per pass", logx=True, logy=True),
    ),
    Benchmark(
        "staging_vs_cp",
        "Model staging against cp",
        "bench/staging_vs_cp.py --gb 0.5 --rounds 3",
        "staging_vs_cp.json",
        timeout_s=90,
        plot=Plot(x="method", y=["gb_per_s"], ylabel="GB/s"),
    ),
    Benchmark(
        "upstream_client",
        "The relay's HTTP client against aiohttp, in process (nginx upstream)",
        "bench/upstream_client.py --rounds 3 --requests 2000",
        "upstream_client.json",
        timeout_s=60,
        needs=["nginx"],
        plot=Plot(x="case", y=["cpu_us"], group="client", ylabel="CPU per request (us)"),
    ),
    Benchmark(
        "batch_throughput",
        "Batch API: batch tokens/s against the engines' direct maximum, interactive TTFT "
        "during a batch",
        "bench/batch_throughput.py --requests 400 --replicas 2 --prefix-words 500 "
        "--doc-words 50 --max-tokens 64 --idle-probes 30 --direct-concurrency 32,128 "
        "--batch-concurrency 32",
        "batch_throughput-sim.json",
        timeout_s=300,
        in_default=False,  # the long run (10,000 requests) is in the section above
    ),
    Benchmark(
        "autoscale_replay",
        "Autoscaling: what-if replay of a day (GPU-hours and TTFT SLO per policy)",
        # No --plot: docs/img/autoscale_replay-day.png is a full run's, cited above.
        "bench/autoscale_replay.py",
        "autoscale_replay.json",
        timeout_s=120,  # ~20 s: a simulated day, no processes
    ),
    Benchmark(
        "pd_goodput",
        "Disaggregated prefill/decode vs colocated: the planner's goodput against the sim's",
        "bench/pd_goodput.py --seeds 3 --steps 4",
        "pd_goodput.json",
        timeout_s=1800,
        in_default=False,  # ~15-25 min on 2 busy cores: the chat case simulates ~400 req/s
    ),
    Benchmark(
        "sim_vs_vllm",
        "Simulator against real vLLM CPU (same tiny model and requests)",
        "bench/sim_vs_vllm.py",
        "sim_vs_vllm.json",
        timeout_s=480,
        needs=["python:vllm"],
        in_default=False,  # a real vLLM start: 1-3 minutes here, more under load
    ),
    Benchmark(
        "router_quality_vllm",
        "Routing quality on 3 real vLLM CPU engines (kv-aware, least-load, round-robin)",
        "bench/router_quality_vllm.py --workloads doc-extraction,system-prompt --repetitions 1",
        "router_quality_vllm.json",
        timeout_s=1200,
        needs=["python:vllm"],
        in_default=False,  # three vLLM starts and six runs: ~10 minutes here
    ),
]


# -- running -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    bench: Benchmark
    status: str  # "ok", "failed (exit N)", "timed out", "skipped: why"
    wall_s: float = 0.0
    stdout: str = ""
    data: dict[str, Any] | None = None
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # 1-min, at the start


def missing(needs: list[str]) -> str:
    for need in needs:
        if need == "root":
            if os.geteuid() != 0:
                return "needs root (a local Slurm cluster)"
        elif need.startswith("python:"):
            if importlib.util.find_spec(need.partition(":")[2]) is None:
                return f"needs the Python package `{need.partition(':')[2]}`"
        elif shutil.which(need) is None and not Path(f"/usr/sbin/{need}").exists():
            return f"needs `{need}`"
    return ""


def stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the benchmark's process group, SIGKILL what is left after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run(bench: Benchmark, python: str) -> Outcome:
    why = missing(bench.needs)
    if why:
        return Outcome(bench, f"skipped: {why}")
    result = RESULTS / bench.result
    before = result.stat().st_mtime if result.exists() else 0.0
    started = time.monotonic()
    # Its own session: on a timeout the whole group goes (engines it started included).
    proc = subprocess.Popen(
        [python, *bench.argv],
        cwd=ROOT,
        env={**os.environ, RESULTS_DIR_ENV: str(RESULTS)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        stdout, _ = proc.communicate()
        return Outcome(bench, f"timed out after {bench.timeout_s} s", bench.timeout_s, stdout)
    wall = time.monotonic() - started
    outcome = Outcome(bench, "ok", wall, stdout)
    if proc.returncode != 0:
        outcome.status = f"failed (exit {proc.returncode})"
        tail = (stderr or stdout).strip().splitlines()[-3:]
        outcome.stdout = stdout + "\n" + "\n".join(tail)
    if result.exists() and result.stat().st_mtime > before:
        outcome.data = json.loads(result.read_text())
    elif outcome.status == "ok":
        outcome.status = f"ok, but it wrote no {result.relative_to(ROOT)}"
    return outcome


# -- rendering ---------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | dict):
        return json.dumps(value)[:40]
    return str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def table_of(outcome: Outcome) -> str:
    bench, data = outcome.bench, outcome.data
    if bench.table is not None and data is not None:
        return bench.table(data)
    if data and isinstance(data.get("rows"), list) and data["rows"]:
        return markdown_table(data["rows"])
    printed = [ln for ln in outcome.stdout.splitlines() if ln.startswith("|")]
    if printed:
        return "\n".join(printed)
    if data:
        flat = {
            k: v for k, v in data.items() if isinstance(v, int | float | str) and k != "machine"
        }
        if flat:
            return markdown_table([{"measure": k, "value": v} for k, v in flat.items()])
    return "(no table)"


def plot_of(outcome: Outcome) -> str:
    """Write the PNG; returns its path relative to docs/ ('' when there is none)."""
    bench, data = outcome.bench, outcome.data
    if bench.plot is None or not data or not isinstance(data.get("rows"), list):
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, rows = bench.plot, data["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    numeric_x = all(isinstance(r.get(p.x), int | float) for r in rows)
    if p.group:
        groups = list(dict.fromkeys(r[p.group] for r in rows))
        xs = list(dict.fromkeys(r[p.x] for r in rows))
        width = 0.8 / len(groups)
        for gi, g in enumerate(groups):
            ys = [next((r[p.y[0]] for r in rows if r[p.x] == x and r[p.group] == g), 0) for x in xs]
            ax.bar([i + gi * width for i in range(len(xs))], ys, width, label=str(g))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(xs))], [str(x) for x in xs])
    elif numeric_x:
        for y in p.y:
            ax.plot([r[p.x] for r in rows], [r[y] for r in rows], marker="o", label=y)
    else:
        width = 0.8 / len(p.y)
        for yi, y in enumerate(p.y):
            ax.bar([i + yi * width for i in range(len(rows))], [r[y] for r in rows], width, label=y)
        ax.set_xticks(range(len(rows)), [str(r[p.x]) for r in rows], rotation=15)
    if p.logx:
        ax.set_xscale("log")
    if p.logy:
        ax.set_yscale("log")
    ax.set_xlabel(p.x)
    ax.set_ylabel(p.ylabel or ", ".join(p.y))
    ax.set_title(bench.title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    path = IMG / f"bench-{bench.name}.png"
    fig.savefig(path)
    plt.close(fig)
    return str(path.relative_to(DOC.parent))


def block(outcome: Outcome, host: str, python: str) -> str:
    bench = outcome.bench
    command = f".venv/bin/python {bench.command}"
    lines = [
        f"<!-- suite:{bench.name} -->",
        f"### {bench.title}",
        "",
        f"    {command}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {host}; load average "
        f"{outcome.load:.1f} at the start; {outcome.status}, {outcome.wall_s:.0f} s.",
        "",
    ]
    if outcome.status.startswith("ok"):
        lines.append(table_of(outcome))
        try:
            image = plot_of(outcome)
        except (KeyError, TypeError, ValueError) as err:
            image = ""
            lines += ["", f"(no plot: {type(err).__name__} {err}; fix its Plot in bench/suite.py)"]
        if image:
            lines += ["", f"![{bench.title}]({image})"]
    elif outcome.stdout.strip():
        lines += ["```", *outcome.stdout.strip().splitlines()[-5:], "```"]
    lines.append(f"<!-- /suite:{bench.name} -->")
    return "\n".join(lines)


def update_doc(text: str, name: str, new_block: str) -> str:
    """Replace benchmark ``name``'s block in the suite section, or append it there."""
    pattern = re.compile(rf"<!-- suite:{re.escape(name)} -->.*?<!-- /suite:{re.escape(name)} -->",
                         re.S)  # fmt: skip
    if pattern.search(text):
        return pattern.sub(lambda _m: new_block, text)
    if SECTION not in text:
        text = text.rstrip("\n") + (
            f"\n\n{SECTION}\n\nWritten by `bench/suite.py` (`make bench`): the latest bounded "
            "run of every registered benchmark. The sections above discuss longer runs.\n"
        )
    return text.rstrip("\n") + "\n\n" + new_block + "\n"


_BLOCK = re.compile(r"<!-- suite:([\w.-]+) -->.*?<!-- /suite:\1 -->", re.S)


def in_suite_order(text: str) -> str:
    """The suite section's blocks in ``BENCHMARKS`` order (others after). Left as it is
    when anything but blocks follows the first block (someone wrote below the suite)."""
    start = text.find(SECTION)
    first = text.find("<!-- suite:", start) if start >= 0 else -1
    if first < 0 or _BLOCK.sub("", text[first:]).strip():
        return text
    found = {m.group(1): m.group(0) for m in _BLOCK.finditer(text[first:])}
    names = {b.name for b in BENCHMARKS}
    order = [b.name for b in BENCHMARKS if b.name in found] + [n for n in found if n not in names]
    return text[:first] + "\n\n".join(found[n] for n in order) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = ap.parse_args()
    if args.list:
        for b in BENCHMARKS:
            extra = "" if b.in_default else "  (only with --only)"
            print(f"{b.name:24} {b.timeout_s:4d} s  {b.title}{extra}")
        return 0
    chosen = [b for b in BENCHMARKS if b.in_default]
    if args.only:
        names = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = names - {b.name for b in BENCHMARKS}
        if unknown:
            known = ", ".join(b.name for b in BENCHMARKS)
            print(f"unknown benchmark(s): {', '.join(sorted(unknown))}; known: {known}")
            return 2
        chosen = [b for b in BENCHMARKS if b.name in names]
    python = sys.executable
    host = machine()
    started = time.monotonic()
    failed = 0
    for bench in chosen:
        elapsed = time.monotonic() - started
        if elapsed + bench.timeout_s > BUDGET_S:
            outcome = Outcome(bench, f"skipped: the suite's {BUDGET_S} s budget is spent")
        else:
            print(f"[bench] {bench.name}: running (at most {bench.timeout_s} s)", flush=True)
            load = os.getloadavg()[0]
            outcome = run(bench, python)
            outcome.load = load
        print(f"[bench] {bench.name}: {outcome.status} ({outcome.wall_s:.0f} s)", flush=True)
        failed += not outcome.status.startswith(("ok", "skipped"))
        if args.no_doc:
            continue
        text = DOC.read_text()
        if (
            outcome.status.startswith("skipped: the suite")
            and f"<!-- suite:{bench.name} -->" in text
        ):
            continue  # keep the last measured block (it carries its own date)
        text = update_doc(text, bench.name, block(outcome, host, python))
        DOC.write_text(in_suite_order(text))
    print(f"[bench] done in {time.monotonic() - started:.0f} s; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
