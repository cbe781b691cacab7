"""A day of interactive traffic compressed in time, through the real gateway, router and
pool manager, under four sizing policies side by side (issue 19).

Four stacks run at once, each its own `hpcserve router`, `hpcserve gateway` and `hpcserve
poolmgr` processes (local launcher: the rendered job scripts run as local processes, each
replica an `hpcserve engine` agent with a simulated engine, `engine = "sim"`), and get the
same requests at the same times:

- static for the peak: `replicas` sized for the day's highest one-minute rate (the bursts);
- static for the average: sized for the day's mean rate;
- reactive (KEDA-like): a loop outside hpcserve that reads every engine's
  `vllm:num_requests_running + vllm:num_requests_waiting` from its /metrics (the targets the
  pool manager writes for Prometheus, `poolmgr.scrape_targets_file`) each KEDA polling
  interval (30 s of the day) and sets the pool's size as Kubernetes' HPA does with an
  AverageValue target (`target_per_replica` = 0.75 x max_num_seqs; desired = ceil(sum /
  target) outside a 10% tolerance, up at most max(2x, +4) per 15 s, down only to the highest
  recommendation of the last 300 s), through the override `hpcserve scale` writes
  (poolmgr/state_files.write_override, the function the command calls: a CLI process per
  change would add a second of real time, two minutes of the day, that KEDA does not have);
- hpcserve: the pool's `[pools.autoscale]` (poolmgr/autoscale.py), its capacity from the
  planner's roofline (`autoscale.capacity`), the forecast from its daily profile and the
  measured cold start.

`--reactive-targets 3,2.5` runs the reactive loop once per HPA target, side by side, as
"reactive (target 3)" and "reactive (target 2.5)": a lower target holds more replicas, so
hpcserve can be compared with a reactive loop that spends the same GPU-hours.
`--estimate-targets` prints, in seconds and without running anything, what the reactive
loop spends at each target in the replay's model of the pool (bench/autoscale_replay.py's
run_policy with this bench's Hpa), to pick such a target.

The day: bench/autoscale_replay.py's profile (night floor, morning and afternoon humps,
evening tail; peak/average ~3.8) with its two 10-minute 2x bursts (11:00, 16:30), Poisson
arrivals at `--peak-rps` at the humps. Compressed `--speedup` times (60: a day in 24
minutes): requests keep their real timing (the engines' TTFT and TPOT are real; a request
arrives at the day's rate), while the day's profile, the cold starts and the autoscaler's
time constants pass `--speedup` times faster: the pool manager's `poolmgr.rehearsal_speedup`
(poolmgr/rehearsal_clock.py), the HPA loop's periods divided by it. Each request is a
streamed chat completion (bench/workload.py's client: aiohttp, open loop), its prompt
lognormal around `--prompt-tokens` up to 4,000 tokens, its output lognormal around
`--output-tokens`; the simulated engines model `--sim-model` on `--sim-gpu` (the planner's
roofline) with `--max-num-seqs` sequences each, streaming as vLLM's `--stream-interval`
(the first token at once, then every N: fewer events for the CPU of this host to carry,
the same TTFT and TPOT). One replica sustains 0.683 req/s by the planner; the defaults
make the day's mean load (0.68 req/s) one replica's worth, static sizing for the peak 8
replicas and the autoscaled pools' max (`--max-replicas`) 1.5 times that, 12. `--peak-rps
5` doubles it to the replay's ratio (5.4 req/s over 2.7 per replica: two replicas' worth;
16 for the peak, max 24): more replicas than this 2-core host runs for four stacks at the
day's humps (docs/benchmarks.md).

Cold start, stated and seeded: Slurm's queue wait exponential with mean `--queue-wait-s`
(`poolmgr.local_queue_wait_s`: the local launcher keeps the job PENDING), then staging +
load uniform from `--load-lo-s` to `--load-hi-s` (the simulated engine's `--sim-load-s`,
counted from its job's start), both in seconds of the day and divided by the speedup; the
n-th job of every stack draws the same (seeded by `--seed` and its job number). The days
before: each pool
manager's state dir is seeded with the daily arrival profile learnt from a day of the same
shape (another seed), and with 20 cold starts drawn from the same distribution, as the
replay does; both are what a pool manager that ran yesterday would hold.

Measured per policy: requests within the SLO (TTFT <= 0.8 s and TPOT <= 0.05 s, each
request), TTFT and TPOT p95, failed requests, GPU-hours of the day (each replica from its
job's start to its end, its queue wait not counted, x 1 GPU; sampled every 1 s from the
jobs' processes), their ratio to static peak sizing, mean GPU utilisation (the engines'
running requests as their heartbeats report them, over the max_num_seqs slots of the
replicas holding GPUs, time-weighted), scaling changes, and the realised cold starts (the
pool manager's own measurements). Results: bench/results/autoscale_day.json; `--plot`:
arrivals, replicas holding GPUs and TTFT p95 per quarter hour of the day per policy.

    .venv/bin/python bench/autoscale_day.py --plot docs/img/autoscale_day.png   # ~27 min
    .venv/bin/python bench/autoscale_day.py --quick   # 09:30-11:30 of the day, ~5 min
    .venv/bin/python bench/autoscale_day.py --seed 20   # another day: autoscale_day-seed20
    .venv/bin/python bench/autoscale_day.py --estimate-targets 3,2.75,2.5   # seconds
    # hpcserve against the reactive loop at two targets (results: autoscale_day-matched)
    .venv/bin/python bench/autoscale_day.py --policies reactive,hpcserve --reactive-targets 3,2.5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from bench.autoscale_replay import (  # noqa: E402
    BASE_EPOCH,
    DAY_S,
    World,
    gpu_figures,
    print_table,
    rate,
    run_policy,
)
from bench.results import load_average, write_results  # noqa: E402
from bench.simfleet import tiny_model  # noqa: E402
from bench.workload import RequestResult, RequestSpec, percentile, run_workload  # noqa: E402
from hpcserve.config import (  # noqa: E402
    PlatformConfig,
    dump_config,
    hash_api_key,
    load_config,
    parse_config,
)

API_KEY = "sk-autoscale-day"
POOL = "chat"
SLO_TTFT_S = 0.8
SLO_TPOT_S = 0.05
BUCKET_S = 900.0  # the plot's and the p95 series' step: a quarter hour of the day
POLICIES = ("static-peak", "static-average", "reactive", "hpcserve")


# -- the day, the cold starts, the reactive policy (pure) ------------------------------------


def arrivals(
    seed: int, peak_rps: float, start_s: float, end_s: float, speedup: float
) -> list[float]:
    """Real seconds from the run's start at which requests arrive: Poisson at the day's
    rate (bench/autoscale_replay.rate, requests/s) at day time start_s + t x speedup, for
    t up to (end_s - start_s) / speedup (thinning against the day's highest rate)."""
    rng = random.Random(seed)
    duration = (end_s - start_s) / speedup
    top = max(rate(start_s + i * 60.0, peak_rps) for i in range(int((end_s - start_s) / 60) + 1))
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= duration:
            return out
        if rng.random() * top <= rate(start_s + t * speedup, peak_rps):
            out.append(t)


@dataclass(frozen=True)
class ColdStart:
    """The stated cold start, in seconds of the day: Slurm's queue wait exponential with
    mean queue_mean_s, then staging + load uniform in [load_lo_s, load_hi_s]."""

    queue_mean_s: float
    load_lo_s: float
    load_hi_s: float

    def samples(self, seed: int, n: int) -> list[tuple[float, float]]:
        """n (queue, load) draws, for the cold starts of the days before."""
        rng = random.Random(seed)
        return [
            (rng.expovariate(1 / self.queue_mean_s), rng.uniform(self.load_lo_s, self.load_hi_s))
            for _ in range(n)
        ]


class Hpa:
    """Kubernetes' HPA on an AverageValue metric (what a KEDA ScaledObject on a Prometheus
    query sets up), with its default behaviour, in seconds of the day: desired =
    ceil(total / target) unless within `tolerance` of the current size; up at most
    max(2 x current, current + 4) per `period_s`; down never below the highest
    recommendation of the last `stabilise_s`; within lo..hi."""

    def __init__(
        self,
        target: float,
        lo: int,
        hi: int,
        start: int,
        *,
        period_s: float = 15.0,
        stabilise_s: float = 300.0,
        tolerance: float = 0.1,
    ) -> None:
        self.target, self.lo, self.hi = target, lo, hi
        self.current = start
        self.period_s, self.stabilise_s, self.tolerance = period_s, stabilise_s, tolerance
        self._recommendations: deque[tuple[float, int]] = deque()
        self._up_at = -math.inf

    def step(self, now: float, total: float) -> int:
        """The size after seeing `total` (the metric summed over the pool) at `now`."""
        ratio = total / (self.target * self.current) if self.current else math.inf
        want = self.current if abs(ratio - 1) <= self.tolerance else math.ceil(total / self.target)
        want = min(max(want, self.lo), self.hi)
        self._recommendations.append((now, want))
        while self._recommendations[0][0] < now - self.stabilise_s:
            self._recommendations.popleft()
        if want > self.current:
            if now - self._up_at < self.period_s:
                return self.current
            self.current = min(want, max(2 * self.current, self.current + 4))
            self._up_at = now
        else:
            self.current = max(w for _, w in self._recommendations)
        return self.current


@dataclass(frozen=True)
class Policy:
    """One stack's policy: its `kind` (one of POLICIES), its `label` (the result rows'
    `policy`, the table's and the plot's name) and, for the reactive loop, its HPA target
    per replica (running + waiting)."""

    kind: str
    label: str
    hpa_target: float | None = None

    @property
    def slug(self) -> str:
        """The stack's work directory: the label without spaces or brackets."""
        if self.hpa_target is None or self.label == self.kind:
            return self.kind
        return f"{self.kind}-t{self.hpa_target:g}"


def parse_targets(text: str) -> list[float]:
    """`--reactive-targets`: comma-separated HPA targets per replica, each > 0, no repeats."""
    try:
        targets = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"not a list of numbers: {text!r}") from None
    bad = [t for t in targets if not (t > 0 and math.isfinite(t))]
    if bad:
        raise ValueError(f"a target must be a number > 0, not {bad[0]:g}")
    if len(set(targets)) != len(targets):
        raise ValueError(f"a target given twice: {text!r}")
    return targets


def expand_policies(
    names: list[str], reactive_targets: list[float], default_target: float
) -> list[Policy]:
    """The stacks to run, in --policies' order. Without --reactive-targets the reactive
    loop runs once at `default_target` (0.75 x max_num_seqs) as "reactive"; with them,
    "reactive" stands for one stack per target, "reactive (target T)", side by side."""
    unknown = sorted(set(names) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a policy named twice: {','.join(names)}")
    if reactive_targets and "reactive" not in names:
        raise ValueError("--reactive-targets needs the reactive policy in --policies")
    out: list[Policy] = []
    for name in names:
        if name != "reactive":
            out.append(Policy(name, name))
        elif not reactive_targets:
            out.append(Policy(name, name, default_target))
        else:
            out += [Policy(name, f"{name} (target {t:g})", t) for t in reactive_targets]
    return out


# -- measuring (pure) ---------------------------------------------------------------------------


@dataclass
class Sample:
    t: float  # real seconds from the day's start
    holding: int  # jobs holding GPUs (started, not ended)
    serving: int  # replicas the router lists
    running: int  # their engines' running requests (heartbeats)


def p95(values: list[float]) -> float | None:
    return percentile(values, 0.95) if values else None


def summarize(
    results: list[RequestResult],
    samples: list[Sample],
    *,
    speedup: float,
    slots: int,
    day_start_s: float,
    duration_s: float,
    gpus_per_replica: int = 1,
) -> dict[str, Any]:
    """One policy's figures over the window's duration_s (real s from its start): SLO
    attainment, latency p95s, failures (a client that gave up, TimeoutError, counted apart),
    GPU-hours of the day and utilisation as the replay counts them
    (bench/autoscale_replay.gpu_figures: the samples' replicas holding GPUs and their
    running requests, x their interval x speedup), and per quarter hour of the day the
    arrivals, the replicas holding GPUs (mean) and the TTFT p95 (None where nothing was
    served)."""
    samples = [s for s in samples if 0 <= s.t <= duration_s]
    ok = [r for r in results if r.ok]
    tpots = [r.tpot_s for r in ok if r.tpot_s >= 0]
    gave_up = [r for r in results if r.error.startswith("TimeoutError")]
    good = [r for r in ok if r.ttft_s <= SLO_TTFT_S and 0 <= r.tpot_s <= SLO_TPOT_S]
    held_s = busy_s = 0.0
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        held_s += a.holding * dt
        busy_s += a.running * dt
    buckets: dict[int, dict[str, Any]] = {}

    def bucket(t_real: float) -> dict[str, Any]:
        k = int((day_start_s + t_real * speedup) // BUCKET_S)
        return buckets.setdefault(k, {"arrivals": 0, "ttft": [], "holding": [], "serving": []})

    for r in results:
        at = bucket(r.at_s)
        at["arrivals"] += 1
        if r.ok:
            at["ttft"].append(r.ttft_s)
    for s in samples:
        bucket(s.t)["holding"].append(s.holding)
        bucket(s.t)["serving"].append(s.serving)
    series = [
        {
            "hour": k * BUCKET_S / 3600,
            "arrivals_rps": b["arrivals"] / (BUCKET_S / speedup),
            "holding": statistics.fmean(b["holding"]) if b["holding"] else 0.0,
            "serving": statistics.fmean(b["serving"]) if b["serving"] else 0.0,
            "ttft_p95_s": p95(b["ttft"]),
        }
        for k, b in sorted(buckets.items())
    ]
    figures = gpu_figures(held_s * speedup, busy_s * speedup, slots, gpus_per_replica)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok) - len(gave_up),
        "timed_out": len(gave_up),
        "errors": dict(Counter(f"{r.status} {r.error[:80]}" for r in results if not r.ok)),
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 0.5) if ok else None,
        "ttft_p95_s": p95([r.ttft_s for r in ok]),
        "tpot_p50_s": percentile(tpots, 0.5) if tpots else None,
        "tpot_p95_s": p95(tpots),
        **figures,
        "series": series,
    }


# -- the stacks ---------------------------------------------------------------------------------


@dataclass
class Stack:
    spec: Policy
    work: Path
    config: PlatformConfig
    config_file: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    changes: int = 0  # for the reactive loop: overrides written

    @property
    def policy(self) -> str:
        """The policy's label (the result rows' `policy`)."""
        return self.spec.label

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.config.gateway.port}"

    @property
    def jobs_dir(self) -> str:
        return str(self.work / "state" / "jobs")

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.log(name).read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"{self.policy}: the {name} exited: " + " | ".join(tail))


def free_ports(n: int) -> list[int]:
    from tests.ports import free_ports as ports

    return ports(n)


def stack_config(
    policy: str,
    work: Path,
    model_dir: Path,
    args: argparse.Namespace,
    sizes: dict[str, int],
    real_start: float,
) -> PlatformConfig:
    registry, routing, gateway, metrics = free_ports(4)
    k = args.speedup
    engine_args = [
        "--sim-gpu",
        args.sim_gpu,
        "--sim-model",
        args.sim_model,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--sim-load-s",
        f"{args.load_lo_s / k:.3f},{args.load_hi_s / k:.3f}",
        "--sim-load-seed",
        str(args.seed),
        "--stream-interval",
        str(args.stream_interval),
    ]
    pool: dict[str, Any] = {
        "name": POOL,
        "model_path": str(model_dir),
        "engine": "sim",
        "replicas": sizes[policy],
        "engine_args": engine_args,
    }
    if policy == "hpcserve":
        pool["autoscale"] = {
            "min": 1,
            "max": args.max_replicas,
            # The SLO windows hold requests, not time: the compressed day has 1/speedup of a
            # day's requests, so they are 15 and 60 minutes of the day (15 s and 60 s of
            # real traffic at 60x) to hold the 20 requests a p95 needs.
            "slo_short_window_s": 900.0,
            "slo_long_window_s": 3600.0,
            "capacity": capacity_config(args),
        }
    raw: dict[str, Any] = {
        "state_dir": str(work / "state"),
        "router": {
            "registry_bind": f"tcp://127.0.0.1:{registry}",
            "routing_bind": f"tcp://127.0.0.1:{routing}",
            "metrics_port": 0,
            # The engines' load reaches the pool manager on heartbeats: every two minutes of
            # the day (2 s at 60x; every heartbeat scrapes the engine's /metrics, the cost of
            # an idle replica); the router's in-flight counts are immediate.
            "heartbeat_s": 120.0 / k,
            "lease_s": 480.0 / k,
        },
        "gateway": {
            "port": gateway,
            "api_keys": [{"tenant": "bench", "sha256": hash_api_key(API_KEY)}],
        },
        "poolmgr": {
            "launcher": "local",
            "poll_s": args.poll_s,
            "metrics_port": metrics,
            # Submissions as often as a poll (the default 2 s is 4 minutes of the day).
            "min_submit_interval_s": args.poll_s / 2,
            "scrape_targets_file": str(work / "state" / "targets.json"),
            "local_queue_wait_s": args.queue_wait_s / k,
            "local_queue_seed": args.seed,
            "rehearsal_speedup": k,
            "rehearsal_real_start": real_start,
            "rehearsal_day_start": BASE_EPOCH + args.start_h * 3600,
        },
        "slurm": {"log_dir": str(work / "state" / "jobs"), "drain_s": 30},
        "engine": {"bind_host": "127.0.0.1", "advertise_host": "127.0.0.1"},
        "pools": [pool],
    }
    return parse_config(raw)


def capacity_config(args: argparse.Namespace) -> dict[str, Any]:
    """The pool's `autoscale.capacity`: the workload on the simulated model and GPU, as the
    planner sizes a replica (static sizing and hpcserve's pool use the same figure)."""
    return {
        "model": args.sim_model,
        "gpu": args.sim_gpu,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "max_num_seqs": args.max_num_seqs,
    }


def seed_state(state: Path, args: argparse.Namespace, cold: ColdStart) -> None:
    """The days before: the daily arrival profile (poolmgr/forecast.py) learnt from a day
    of the same shape (another seed, observed once a poll as the pool manager does) and 20
    cold starts drawn from the stated distribution, in the compressed run's real seconds."""
    from hpcserve.poolmgr.cold_start import KEEP, ColdStartSample
    from hpcserve.poolmgr.forecast import Forecasts

    state.mkdir(parents=True, exist_ok=True)
    forecasts = Forecasts(state)  # writes <state>/arrival-profiles.json as quarter hours end
    rng = random.Random(args.seed + 10_000)
    step = args.poll_s * args.speedup
    day_before = BASE_EPOCH - DAY_S
    t = 0.0
    while t <= DAY_S:
        lam = rate(t, args.peak_rps) * step
        forecasts.observe(POOL, _poisson(rng, lam), day_before + t)
        t += step
    k = args.speedup
    history = [
        ColdStartSample(0, round(q / k, 3), round(s / k, 3), day_before)
        for q, s in cold.samples(args.seed + 20_000, KEEP)
    ]
    (state / "cold-starts.json").write_bytes(msgspec.json.encode({POOL: history}))


def _poisson(rng: random.Random, lam: float) -> int:
    if lam > 50:  # normal approximation
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    threshold, n, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= threshold:
            return n
        n += 1


def spawn(stack: Stack, name: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The job scripts run `hpcserve` (this venv's console script).
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    out = stack.log(name).open("wb")
    stack.procs[name] = subprocess.Popen(
        [sys.executable, "-m", "hpcserve.cli", name, "--config", str(stack.config_file)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
    )
    out.close()


def stop(stack: Stack) -> None:
    """Pool manager first (it drains its local jobs), then gateway and router."""
    for name in ("poolmgr", "gateway", "router"):
        proc = stack.procs.get(name)
        if proc is None or proc.poll() is not None:
            continue
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serving(stack: Stack) -> list[Any]:
    from hpcserve.contracts.router_client import list_replicas

    return [
        r
        for r in list_replicas(
            stack.config.router.routing_bind, 1.0, curve_dir=stack.config.router.curve_dir
        )
        if r.pool == POOL
    ]


def holding_jobs(stacks: list[Stack]) -> dict[str, int]:
    """Per stack, its local jobs whose script runs (started: queue wait over, not ended)."""
    counts = {s.policy: 0 for s in stacks}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) >= 2 and argv[0] == b"bash" and argv[1].endswith(b".sh"):
            script = argv[1].decode(errors="replace")
            for s in stacks:
                if script.startswith(s.jobs_dir + "/"):
                    counts[s.policy] += 1
    return counts


def sampler(stacks: list[Stack], t0: float, stop_event: threading.Event, every_s: float) -> None:
    while not stop_event.wait(every_s):
        held = holding_jobs(stacks)
        now = time.time() - t0
        for s in stacks:
            try:
                reps = serving(s)
            except Exception:  # the router busy past 1 s: count what the jobs show
                reps = []
            running = sum(r.load.running for r in reps)
            s.samples.append(Sample(now, held[s.policy], len(reps), running))


_METRIC = re.compile(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def engine_queue(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
        text = resp.read().decode()
    return float(sum(float(m.group(2)) for m in _METRIC.finditer(text)))


def default_hpa_target(args: argparse.Namespace) -> float:
    """The reactive loop's target per replica unless --reactive-targets says otherwise."""
    return 0.75 * float(args.max_num_seqs)


def reactive_loop(
    stack: Stack, args: argparse.Namespace, t0: float, stop_event: threading.Event
) -> None:
    """KEDA + HPA outside hpcserve: scrape the engines the pool manager lists for
    Prometheus, sum running + waiting, size the pool through `hpcserve scale`'s override."""
    from hpcserve.poolmgr.state_files import write_override

    k = args.speedup
    target = stack.spec.hpa_target or default_hpa_target(args)
    hpa = Hpa(target, 1, args.max_replicas, stack.config.pools[0].replicas)
    targets = Path(stack.config.poolmgr.scrape_targets_file)
    state = Path(stack.config.state_dir)
    while not stop_event.wait(30.0 / k):  # KEDA's default pollingInterval, 30 s of the day
        try:
            groups = json.loads(targets.read_text())
        except (OSError, ValueError):
            continue
        total = 0.0
        for group in groups:
            for address in group.get("targets", []):
                with contextlib.suppress(OSError):
                    total += engine_queue(f"http://{address}")
        before = hpa.current
        after = hpa.step((time.time() - t0) * k, total)
        if after != before:
            write_override(state, POOL, after)
            stack.changes += 1


def realised_cold_starts(stack: Stack) -> list[dict[str, float]]:
    """The pool manager's own measurements during the run (not the seeded history)."""
    path = Path(stack.config.state_dir) / "cold-starts.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [s for s in data.get(POOL, []) if s.get("job_id")]


def hpcserve_changes(stack: Stack) -> int:
    text = stack.log("poolmgr").read_text(errors="replace")
    return len(re.findall(r"pool chat: autoscale (?:up|down) ", text))


@contextlib.contextmanager
def stacks_running(
    args: argparse.Namespace,
    work: Path,
    sizes: dict[str, int],
    real_start: float,
    cold: ColdStart,
) -> Iterator[list[Stack]]:
    model_dir = tiny_model(work)
    stacks: list[Stack] = []
    try:
        for policy in args.policies:
            sub = work / policy.slug
            (sub / "logs").mkdir(parents=True)
            config = stack_config(policy.kind, sub, model_dir, args, sizes, real_start)
            config_file = sub / "hpcserve.toml"
            config_file.write_text(dump_config(config))
            stack = Stack(policy, sub, load_config(config_file), config_file)
            seed_state(sub / "state", args, cold)
            stacks.append(stack)
            for name in ("router", "gateway", "poolmgr"):
                spawn(stack, name)
        yield stacks
    finally:
        threads = [threading.Thread(target=stop, args=(s,)) for s in stacks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def wait_ready(stacks: list[Stack], deadline: float) -> None:
    """Until every stack's router lists its pool's starting size and its gateway answers."""
    pending = list(stacks)
    while pending:
        if time.time() > deadline:
            raise TimeoutError(
                "not ready before the day starts: "
                + ", ".join(f"{s.policy} ({len(_try(serving, s))} serving)" for s in pending)
                + "; raise --startup-s"
            )
        for s in list(pending):
            s.check()
            if len(_try(serving, s)) >= s.config.pools[0].replicas and _gateway_up(s):
                pending.remove(s)
        time.sleep(0.5)


def _try(fn: Callable[[Stack], list[Any]], s: Stack) -> list[Any]:
    try:
        return fn(s)
    except Exception:
        return []


def _gateway_up(s: Stack) -> bool:
    try:
        with urllib.request.urlopen(s.base_url + "/health", timeout=2):
            return True
    except OSError:
        return False


# -- the workload ---------------------------------------------------------------------------------


def build_specs(args: argparse.Namespace, times: list[float], model_dir: Path) -> list[RequestSpec]:
    """A streamed chat request per arrival: a prompt of lognormal length (median
    --prompt-tokens, up to 4,000 tokens) of unique text (no prefix-cache hit between
    requests), an output of lognormal length around --output-tokens."""
    from bench.workload import Lengths, make_text
    from hpcserve.sim.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))

    def count(text: str) -> int:
        return len(tokenizer.prompt_ids(text))

    rng = random.Random(args.seed + 30_000)
    base = make_text(4000, rng, count).split()
    per_word = count(" ".join(base)) / len(base)
    prompt = Lengths("lognormal", mean=args.prompt_tokens, low=32, high=4000, sigma=0.8)
    output = Lengths(
        "lognormal", mean=args.output_tokens, low=8, high=4 * args.output_tokens, sigma=0.5
    )
    specs = []
    for i, at in enumerate(times):
        words = max(1, int(prompt.draw(rng) / per_word))
        start = rng.randrange(0, len(base) - words) if words < len(base) else 0
        text = f"request {i} {rng.getrandbits(64):x}: " + " ".join(base[start : start + words])
        specs.append(RequestSpec(at, [{"role": "user", "content": text}], output.draw(rng)))
    return specs


async def drive(
    stacks: list[Stack], specs: list[RequestSpec], real_start: float, timeout_s: float
) -> list[list[RequestResult]]:
    """Every stack gets every request at its time; a client gives up on a request after
    timeout_s (real s), so a policy that queues without end does not hold up the run."""
    await asyncio.sleep(max(real_start - time.time(), 0))
    runs = [
        run_workload(
            specs,
            s.base_url,
            model=POOL,
            api_key=API_KEY,
            timeout_s=timeout_s,
            keepalive_timeout_s=2.0,
        )
        for s in stacks
    ]
    return list(await asyncio.gather(*runs))


# -- the report --------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, reps, ttft) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    first = rows[0]["series"]
    load.step(
        [b["hour"] for b in first],
        [b["arrivals_rps"] for b in first],
        where="post",
        color="black",
        lw=0.9,
    )
    load.set_ylabel("arrivals (req/s)")
    load.set_title(title, fontsize=9)
    for row in rows:
        series = row["series"]
        hours = [b["hour"] for b in series]
        reps.step(hours, [b["holding"] for b in series], where="post", label=row["policy"], lw=1)
        ttft.step(
            hours,
            [max(b["ttft_p95_s"] or 0.0, 0.05) for b in series],
            where="post",
            label=row["policy"],
            lw=0.9,
        )
    reps.set_ylabel("replicas holding GPUs\n(mean per quarter hour)")
    reps.legend(fontsize=8)
    ttft.axhline(SLO_TTFT_S, color="red", ls="--", lw=0.8)
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT p95 per quarter hour (s)")
    ttft.set_xlabel("hour of the day")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def sizes_for(args: argparse.Namespace) -> tuple[dict[str, int], dict[str, float]]:
    """Static sizes from the planner's capacity of one replica (the figure hpcserve's pool
    gets): the highest one-minute rate of the day (bursts included) or its mean, at
    --static-utilisation of that capacity."""
    from hpcserve.poolmgr.autoscale_capacity import modelled

    probe = parse_config(
        {
            "pools": [
                {
                    "name": POOL,
                    "model_path": "/unused",
                    "engine": "sim",
                    "autoscale": {"max": 1, "capacity": capacity_config(args)},
                }
            ]
        }
    )
    capacity = modelled(probe.pools[0])
    per_replica = (capacity.requests_per_s or 1.0) * args.static_utilisation
    day = [rate(m * 60.0, args.peak_rps) for m in range(1440)]
    peak, mean = max(day), statistics.fmean(day)
    sizes = {
        "static-peak": math.ceil(peak / per_replica),
        "static-average": max(1, math.ceil(mean / per_replica)),
        "reactive": 1,
        "hpcserve": 1,
    }
    return sizes, {
        "max_rps": peak,
        "mean_rps": mean,
        "replica_rps": capacity.requests_per_s or 0.0,
        "replica_in_flight": capacity.in_flight,
    }


def estimate_reactive(
    targets: list[float],
    *,
    seed: int,
    peak_rps: float,
    window_s: tuple[float, float],
    cold: ColdStart,
    slots: int,
    service_s: float,
    max_replicas: int,
    dt: float = 0.25,
) -> list[dict[str, Any]]:
    """The reactive loop (this bench's Hpa, stepped every 30 s of the day on running +
    waiting, min 1, max max_replicas) at each target, in the replay's model of a pool
    (bench/autoscale_replay.run_policy: Poisson arrivals at the day's rate, a FIFO queue,
    replicas of `slots` sequences busy `service_s` per request, the stated cold starts;
    TTFT is the queue wait + 0.15 s): seconds of CPU instead of a run, to pick the target
    that spends a given number of GPU-hours. Per target: GPU-hours of the window, requests
    within TTFT 0.8 s, utilisation and scaling changes."""
    import numpy as np

    start_s, end_s = window_s
    steps = round((end_s - start_s) / dt)
    lam = np.array([rate(start_s + i * dt, peak_rps) * dt for i in range(steps)])
    arrived = np.random.default_rng(seed).poisson(lam)
    model = argparse.Namespace(slots=slots, service_s=service_s, dt=dt, prefill_s=0.15, poll_s=30.0)
    out = []
    for target in targets:
        rng = random.Random(seed)  # the same cold starts for every target

        def draw(r: random.Random = rng) -> tuple[float, float]:
            return r.expovariate(1 / cold.queue_mean_s), r.uniform(cold.load_lo_s, cold.load_hi_s)

        hpa = Hpa(target, 1, max_replicas, 1)

        def reactive(world: World, now: float, hpa: Hpa = hpa) -> int:
            return hpa.step(now, world.queued + world.in_service)

        result = run_policy(reactive, arrived, draw, model, 1)
        out.append(
            {
                "hpa_target": target,
                "gpu_hours": result["gpu_hours"],
                "ttft_attainment": result["slo_attainment"],
                "utilisation": result["utilisation"],
                "changes": result["changes"],
            }
        )
    return out


def policy_row(
    stack: Stack,
    results: list[RequestResult],
    args: argparse.Namespace,
    start_size: int,
    start_s: float,
    end_s: float,
) -> dict[str, Any]:
    """One policy's figures (summarize), its scaling changes and its realised cold starts."""
    k = args.speedup
    row = {
        "policy": stack.policy,
        **({} if stack.spec.hpa_target is None else {"hpa_target": stack.spec.hpa_target}),
        "replicas_at_start": start_size,
        **summarize(
            results,
            stack.samples,
            speedup=k,
            slots=args.max_num_seqs,
            day_start_s=start_s,
            duration_s=(end_s - start_s) / k,
        ),
    }
    changes: dict[str, Callable[[Stack], int]] = {
        "hpcserve": hpcserve_changes,
        "reactive": lambda s: s.changes,
    }
    count = changes.get(stack.spec.kind)
    row["changes"] = count(stack) if count else 0
    row.update(cold_start_figures(realised_cold_starts(stack), k))
    return row


def cold_start_figures(cold_starts: list[dict[str, float]], speedup: float) -> dict[str, Any]:
    """How many cold starts, and their medians and p90 in seconds of the day."""
    out: dict[str, Any] = {"cold_starts": len(cold_starts)}
    if cold_starts:
        totals = sorted(c["queue_s"] + c["startup_s"] for c in cold_starts)
        out["cold_start_day_s"] = {
            "queue_median": round(statistics.median(c["queue_s"] for c in cold_starts) * speedup),
            "load_median": round(statistics.median(c["startup_s"] for c in cold_starts) * speedup),
            "total_median": round(statistics.median(totals) * speedup),
            "total_p90": round(totals[math.ceil(0.9 * len(totals)) - 1] * speedup),
        }
    return out


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Markdown table's rows; sets each row's gpu_hours_vs_static_peak."""
    peak_hours = next((r["gpu_hours"] for r in rows if r["policy"] == "static-peak"), None)
    table = []
    for row in rows:
        ratio = row["gpu_hours"] / peak_hours if peak_hours else None
        row["gpu_hours_vs_static_peak"] = ratio
        table.append(
            {
                "policy": row["policy"],
                "within SLO": f"{row['slo_attainment']:.2%}",
                "TTFT p50 / p95 (s)": f"{_fmt(row['ttft_p50_s'])} / {_fmt(row['ttft_p95_s'])}",
                "TPOT p50 / p95 (ms)": (
                    f"{_fmt(row['tpot_p50_s'], 1000)} / {_fmt(row['tpot_p95_s'], 1000)}"
                ),
                "GPU-hours": round(row["gpu_hours"], 1),
                "vs static peak": "-" if ratio is None else round(ratio, 2),
                "GPU utilisation": f"{row['utilisation']:.0%}",
                "scaling changes": row["changes"],
                "failed": row["failed"],
                "client gave up": row["timed_out"],
            }
        )
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="09:30-11:30 only, 60 s to start (~5 min)")
    ap.add_argument("--start-h", type=float, default=0.0, help="the day's window (hours)")
    ap.add_argument("--end-h", type=float, default=24.0)
    ap.add_argument("--speedup", type=float, default=60.0, help="day seconds per real second")
    ap.add_argument("--peak-rps", type=float, default=2.5, help="requests/s at the humps")
    ap.add_argument("--prompt-tokens", type=int, default=800, help="median prompt (up to 4k)")
    ap.add_argument("--output-tokens", type=int, default=250, help="mean output (lognormal)")
    ap.add_argument("--sim-gpu", default="l40s")
    ap.add_argument("--sim-model", default="llama-3.1-8b")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=10,
        help="vLLM's --stream-interval: the first token at once, then every N tokens",
    )
    ap.add_argument(
        "--max-replicas",
        type=int,
        default=0,
        help="autoscaled pools' max (default: 1.5 x the static peak size)",
    )
    ap.add_argument(
        "--static-utilisation",
        type=float,
        default=0.8,
        help="static sizing: the share of a replica's modelled requests/s used",
    )
    ap.add_argument("--queue-wait-s", type=float, default=120.0, help="mean queue wait (day s)")
    ap.add_argument("--load-lo-s", type=float, default=600.0, help="staging + load (day s)")
    ap.add_argument("--load-hi-s", type=float, default=1200.0)
    ap.add_argument(
        "--poll-s", type=float, default=0.0, help="pool manager poll (real s; a minute of the day)"
    )
    ap.add_argument(
        "--startup-s",
        type=float,
        default=90.0,
        help="real seconds allowed for the four stacks to start",
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--reactive-targets",
        default="",
        help="HPA targets per replica, e.g. 3,2.5: the reactive policy once per target, side "
        "by side, as 'reactive (target T)' (default: once, 0.75 x --max-num-seqs, 'reactive')",
    )
    ap.add_argument(
        "--client-timeout-s",
        type=float,
        default=60.0,
        help="a client gives up on a request after this (real s; an hour of the day at 60x)",
    )
    ap.add_argument(
        "--estimate-targets",
        default="",
        help="print the reactive loop's GPU-hours and TTFT attainment at these HPA targets in "
        "the replay's model of the pool (seconds; nothing runs) and exit",
    )
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--name", default="")
    ap.add_argument("--plot", default="", help="PNG of load, replicas and TTFT p95")
    ap.add_argument("--keep", default="", help="keep the stacks' work directory here")
    args = ap.parse_args()
    if args.quick:  # the morning hump and the 11:00 burst
        args.start_h, args.end_h, args.startup_s = 9.5, 11.5, 60.0
    args.poll_s = args.poll_s or 60.0 / args.speedup
    try:
        args.reactive_targets = parse_targets(args.reactive_targets)
    except ValueError as e:
        ap.error(f"--reactive-targets: {e}")
    try:
        args.policies = expand_policies(
            [p for p in args.policies.split(",") if p],
            args.reactive_targets,
            default_hpa_target(args),
        )
    except ValueError as e:
        ap.error(f"--policies: {e}")
    name = args.name or "autoscale_day" + ("-matched" if args.reactive_targets else "") + (
        "-quick" if args.quick else ""
    ) + (f"-seed{args.seed}" if args.seed != 19 else "")
    load_before = load_average()
    started = time.monotonic()
    cold = ColdStart(args.queue_wait_s, args.load_lo_s, args.load_hi_s)
    sizes, rates = sizes_for(args)
    if not args.max_replicas:  # room above peak sizing for a backlog, within this host's memory
        args.max_replicas = math.ceil(1.5 * sizes["static-peak"])
    start_s, end_s = args.start_h * 3600, args.end_h * 3600
    if args.estimate_targets:
        try:
            targets = parse_targets(args.estimate_targets)
        except ValueError as e:
            ap.error(f"--estimate-targets: {e}")
        estimates = estimate_reactive(
            targets,
            seed=args.seed,
            peak_rps=args.peak_rps,
            window_s=(start_s, end_s),
            cold=cold,
            slots=args.max_num_seqs,
            service_s=rates["replica_in_flight"] / rates["replica_rps"],
            max_replicas=args.max_replicas,
        )
        print_table(
            [
                {
                    "HPA target": e["hpa_target"],
                    "GPU-hours": round(e["gpu_hours"], 1),
                    "TTFT <= 0.8 s": f"{e['ttft_attainment']:.2%}",
                    "GPU utilisation": f"{e['utilisation']:.0%}",
                    "scaling changes": e["changes"],
                }
                for e in estimates
            ]
        )
        return 0
    times = arrivals(args.seed, args.peak_rps, start_s, end_s, args.speedup)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="autoscale-day-"))
    if args.keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    specs = build_specs(args, times, tiny_model(work))
    real_start = time.time() + args.startup_s
    print(
        f"{len(specs)} requests over {(end_s - start_s) / args.speedup:.0f} s; sizes {sizes}, "
        f"max {args.max_replicas}; one replica {rates['replica_rps']:.3g} req/s, the day's mean "
        f"{rates['mean_rps'] / rates['replica_rps']:.2f} replicas' worth; "
        f"the day starts in {args.startup_s:g} s",
        file=sys.stderr,
    )
    stop_event = threading.Event()
    threads: list[threading.Thread] = []
    try:
        with stacks_running(args, work, sizes, real_start, cold) as stacks:
            wait_ready(stacks, real_start)
            print(f"ready {real_start - time.time():.0f} s before the day starts", file=sys.stderr)
            threads.append(
                threading.Thread(
                    target=sampler, args=(stacks, real_start, stop_event, 1.0), daemon=True
                )
            )
            threads += [
                threading.Thread(
                    target=reactive_loop, args=(s, args, real_start, stop_event), daemon=True
                )
                for s in stacks
                if s.spec.kind == "reactive"
            ]
            for t in threads:
                t.start()
            results = asyncio.run(drive(stacks, specs, real_start, args.client_timeout_s))
            stop_event.set()
            for t in threads:
                t.join(10)
            for s in stacks:
                s.check()
            rows = [
                policy_row(s, res, args, sizes[s.spec.kind], start_s, end_s)
                for s, res in zip(stacks, results, strict=True)
            ]
    finally:
        stop_event.set()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    table = table_rows(rows)
    print_table(table)
    if args.plot:
        title = (
            f"{len(specs)} requests, {args.start_h:g}:00-{args.end_h:g}:00 of the day at "
            f"{args.speedup:g}x; {args.sim_model} on {args.sim_gpu}, "
            f"max_num_seqs {args.max_num_seqs}"
        )
        plot(rows, Path(args.plot), title)
    write_results(
        name,
        {"rows": table, "policies": rows},
        {
            "window_h": [args.start_h, args.end_h],
            "speedup": args.speedup,
            "requests": len(specs),
            **{k: round(v, 3) for k, v in rates.items()},
            "sizes": sizes,
            "peak_rps": args.peak_rps,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "sim": f"{args.sim_model} on {args.sim_gpu}",
            "max_num_seqs": args.max_num_seqs,
            "stream_interval": args.stream_interval,
            "max_replicas": args.max_replicas,
            "cold_start_day_s": {
                "queue_mean": args.queue_wait_s,
                "load": [args.load_lo_s, args.load_hi_s],
            },
            "poll_s": args.poll_s,
            "hpa_targets": {p.label: p.hpa_target for p in args.policies if p.hpa_target},
            "seed": args.seed,
            "load_average_before": load_before,
            "wall_s": round(time.monotonic() - started, 1),
        },
    )
    return 0


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.3g}"


if __name__ == "__main__":
    sys.exit(main())
