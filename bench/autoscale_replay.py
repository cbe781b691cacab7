"""What-if replay of the pool manager's autoscaler (poolmgr/autoscale.py, the same
`decide` the pool manager calls) over a day of interactive traffic, against static sizing for
the peak and for the average and a reactive queue-length policy (what a KEDA/HPA setup on
vLLM's `num_requests_waiting` does).

Nothing real runs: a day (86,400 simulated seconds, in steps of `--dt`) of Poisson arrivals
with a working-day profile (night floor, morning ramp, two humps, evening tail; peak/average
~4x) and two 10-minute 2x bursts, served by replicas modelled as `--slots` sequences each
(vLLM's max_num_seqs) for `--service-s` per request (a fixed decode time), FIFO. A new
replica serves after a cold start: Slurm queue wait (exponential, mean `--queue-wait-s`),
then staging and load (uniform in `--load-s`); GPU time counts from the end of the queue
wait until a drained replica's last request ends. TTFT is the queue wait of a request plus
`--prefill-s`; the SLO is TTFT <= 0.8 s. Each policy sees the same arrivals and the same
cold starts (one seed), polled every `--poll-s`.

    .venv/bin/python bench/autoscale_replay.py            # a day, ~1 min
    .venv/bin/python bench/autoscale_replay.py --days 0.25 --name autoscale_replay-quick

The full policy (`hpcserve: forecast ...`) runs what the pool manager runs besides the
queue rules: each replica's capacity as the planner would give it (`--slots` in flight,
the requests/s they finish; decide() adds its queueing margin), the arrival forecast
(poolmgr/forecast.py: trend plus a daily profile learned from the day before, replayed into
it first) one measured cold start
ahead (the p90 of the pool's last 20 cold starts, poolmgr/cold_start.py, seeded with 20
from the days before), an admin's schedule floor raised ahead by that cold start
(poolmgr/autoscale_schedule.py), and scale to zero: `--trace rare` is a rarely used
model (a request every ~2 minutes in working hours, none at night) where `min = 0` is
compared with a pool that keeps one replica. Sim time 0 is local midnight of a Monday.
`--seeds N` repeats the day with N seeds and reports each policy's median.

Results: bench/results/<name>.json (rows: policy, GPU-hours and their ratio to static peak
sizing, SLO attainment, TTFT p95, mean GPU utilisation, scaling changes).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import numpy as np

from bench.results import write_results
from hpcserve.config import AutoscaleConfig, ScheduleFloor
from hpcserve.poolmgr.autoscale import (
    AutoscaleState,
    ReplicaSignal,
    Signals,
    decide,
)
from hpcserve.poolmgr.autoscale_schedule import scheduled_floor
from hpcserve.poolmgr.cold_start import KEEP, ColdStartSample, estimate
from hpcserve.poolmgr.forecast import Forecasts

DAY_S = 86_400.0
SLO_TTFT_S = 0.8
BASE_EPOCH = datetime(2026, 12, 7).timestamp()  # sim time 0: a Monday's local midnight


def day_profile(t: float) -> float:
    """Relative arrival rate at time of day t (s): 0.05 at night, 1.0 at the morning hump,
    0.9 in the afternoon, 0.35 in the evening; peak/average 3.8."""
    h = (t % DAY_S) / 3600

    def hump(center: float, width: float) -> float:
        return math.exp(-(((h - center) / width) ** 2))

    return 0.05 + 0.95 * max(hump(10.5, 1.3), 0.9 * hump(15, 1.5), 0.35 * hump(20, 1.2))


def rare_rate(t: float, peak_rps: float) -> float:
    """A rarely used model: working hours (08:00-19:00) at the day profile, nothing else."""
    h = (t % DAY_S) / 3600
    return peak_rps * day_profile(t) if 8 <= h < 19 else 0.0


def rate(t: float, peak_rps: float) -> float:
    burst = 2.0 if 11 * 3600 <= t % DAY_S < 11 * 3600 + 600 else 1.0
    if 16.5 * 3600 <= t % DAY_S < 16.5 * 3600 + 600:
        burst = 2.0
    return peak_rps * day_profile(t) * burst


@dataclass
class Replica:
    gpu_from: float  # when it holds GPUs (after Slurm's queue wait)
    ready_at: float  # when it serves
    drained_at: float | None = None


@dataclass
class World:
    """The pool: replicas, the FIFO queue of arrival groups, the running groups."""

    slots: int
    service_s: float
    replicas: list[Replica] = field(default_factory=list)
    queue: deque[list[float]] = field(default_factory=deque)  # [arrival time, count]
    running: deque[tuple[float, int]] = field(default_factory=deque)  # (finish time, count)
    queued: int = 0
    in_service: int = 0
    gpu_s: float = 0.0
    busy_slot_s: float = 0.0
    ttft_hist: dict[float, int] = field(default_factory=dict)  # wait rounded to dt -> count
    served: int = 0
    changes: int = 0
    # Per simulated minute: (hour, arrivals/s, replicas serving, holding GPUs, TTFT p95 s)
    series: list[tuple[float, float, int, int, float]] = field(default_factory=list)
    minute_waits: dict[float, int] = field(default_factory=dict)
    minute_arrivals: int = 0
    arrived: int = 0  # requests so far
    last_arrival: float = -math.inf
    cold_log: list[tuple[float, float, float]] = field(default_factory=list)  # ready, wait, load

    def serving(self, now: float) -> list[Replica]:
        return [r for r in self.replicas if r.drained_at is None and r.ready_at <= now]

    def starting(self, now: float) -> int:
        return sum(1 for r in self.replicas if r.drained_at is None and r.ready_at > now)

    def size(self) -> int:
        return sum(1 for r in self.replicas if r.drained_at is None)


def run_policy(
    policy: Callable[[World, float], int],
    arrivals: np.ndarray,
    cold: Callable[[], tuple[float, float]],
    args: argparse.Namespace,
    start: int,
) -> dict[str, Any]:
    world = World(args.slots, args.service_s)
    dt = args.dt
    for _ in range(start):  # the day starts with `start` replicas up
        world.replicas.append(Replica(gpu_from=0.0, ready_at=0.0))
    poll_every = max(1, round(args.poll_s / dt))
    serving_n = holding = 0
    next_event = -math.inf
    for step, count in enumerate(arrivals.tolist()):
        now = step * dt
        if step % poll_every == 0:
            resize(world, policy(world, now), now, cold)
            next_event = -math.inf
        if now >= next_event:  # a replica got its GPUs, started serving or finished draining
            world.replicas = [
                r for r in world.replicas if r.drained_at is None or now < r.drained_at
            ]
            serving_n = len(world.serving(now))
            holding = sum(1 for r in world.replicas if r.gpu_from <= now)
            times = [t for r in world.replicas for t in (r.gpu_from, r.ready_at, r.drained_at or 0)]
            next_event = min((t for t in times if t > now), default=math.inf)
        while world.running and world.running[0][0] <= now:
            world.in_service -= world.running.popleft()[1]
        if count:
            world.queue.append([now, count])
            world.queued += count
            world.arrived += count
            world.last_arrival = now
        free = world.slots * serving_n - world.in_service
        while free > 0 and world.queue:
            group = world.queue[0]
            take = min(free, int(group[1]))
            wait = round(now - group[0], 6)
            world.ttft_hist[wait] = world.ttft_hist.get(wait, 0) + take
            world.minute_waits[wait] = world.minute_waits.get(wait, 0) + take
            world.running.append((now + world.service_s, take))
            world.in_service += take
            world.queued -= take
            world.served += take
            free -= take
            group[1] -= take
            if group[1] == 0:
                world.queue.popleft()
        world.gpu_s += holding * dt
        world.busy_slot_s += world.in_service * dt
        world.minute_arrivals += count
        if (step + 1) % round(60 / dt) == 0:
            record_minute(world, now, serving_n, holding, args.prefill_s)
    return summary(world, args) | {"series": world.series}


def record_minute(world: World, now: float, serving: int, holding: int, prefill_s: float) -> None:
    waits = sorted(world.minute_waits.items())
    total, seen, p95 = sum(world.minute_waits.values()), 0, 0.0
    for w, n in waits:
        seen += n
        if seen >= 0.95 * total:
            p95 = w + prefill_s
            break
    world.series.append((now / 3600, world.minute_arrivals / 60, serving, holding, p95))
    world.minute_waits, world.minute_arrivals = {}, 0


def resize(world: World, target: int, now: float, cold: Callable[[], tuple[float, float]]) -> None:
    size = world.size()
    if target == size:
        return
    world.changes += 1
    if target > size:
        for _ in range(target - size):
            wait, load = cold()
            world.replicas.append(Replica(gpu_from=now + wait, ready_at=now + wait + load))
            world.cold_log.append((now + wait + load, wait, load))
        return
    # Down: the newest first; one still in Slurm's queue is cancelled (no GPU time), a
    # serving one drains (GPU time until its requests are done).
    live = [r for r in world.replicas if r.drained_at is None]
    for r in sorted(live, key=lambda r: -r.ready_at)[: size - target]:
        if r.gpu_from > now:
            world.replicas.remove(r)
        else:
            r.drained_at = now + (world.service_s if r.ready_at <= now else 0.0)


def gpu_figures(
    held_replica_s: float, busy_slot_s: float, slots: int, gpus_per_replica: int = 1
) -> dict[str, float]:
    """GPU-hours and mean GPU utilisation, the same for the replay and the compressed day
    (bench/autoscale_day.py): `held_replica_s`, replica-seconds holding GPUs (from the end of
    a replica's Slurm queue wait to the end of its drain, its load counted as held and
    serving nothing); `busy_slot_s`, the sequence slots running a request, integrated over
    time (seconds of the day both); utilisation is busy slots over the held replicas'
    `slots` (max_num_seqs) each."""
    return {
        "gpu_hours": held_replica_s * gpus_per_replica / 3600,
        "utilisation": busy_slot_s / (held_replica_s * slots) if held_replica_s else 0.0,
    }


def print_table(table: list[dict[str, Any]]) -> None:
    """Rows of the same keys as a Markdown table on stdout (the keys are the header)."""
    print("| " + " | ".join(table[0]) + " |")
    print("|" + "---|" * len(table[0]))
    for row in table:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


def summary(world: World, args: argparse.Namespace) -> dict[str, Any]:
    total = sum(world.ttft_hist.values()) + world.queued
    good = sum(n for w, n in world.ttft_hist.items() if w + args.prefill_s <= SLO_TTFT_S)
    waits = sorted(world.ttft_hist.items())
    p95: float | None = None  # None: 5% or more were never served (the queue only grew)
    seen = 0
    for w, n in waits:
        seen += n
        if seen >= 0.95 * total:
            p95 = w + args.prefill_s
            break
    figures = gpu_figures(world.gpu_s, world.busy_slot_s, world.slots)
    return {
        "gpu_hours": figures["gpu_hours"],
        "slo_attainment": good / total if total else 1.0,
        "ttft_p95_s": p95,
        "utilisation": figures["utilisation"],
        "changes": world.changes,
        "requests": total,
    }


def signals(world: World, now: float) -> Signals:
    """What the pool manager would see: each serving replica's share of the load."""
    serving = world.serving(now)
    n = len(serving)
    if not n:
        return Signals([], starting=world.starting(now))
    running, waiting = world.in_service / n, world.queued / n
    kv = min(1.0, running / world.slots)
    one = ReplicaSignal(
        in_flight=round(running + waiting),
        running=round(running),
        waiting=round(waiting),
        kv_usage=kv,
    )
    return Signals([one] * n, starting=world.starting(now))


def hpcserve_policy(cfg: AutoscaleConfig, start: int) -> Callable[[World, float], int]:
    state = AutoscaleState(target=start)

    def policy(world: World, now: float) -> int:
        nonlocal state
        decision = decide(cfg, signals(world, now), state, now)
        state = decision.state
        return decision.target

    return policy


def learned_forecasts(arrivals: np.ndarray, dt: float, poll_s: float) -> Forecasts:
    """The pool's forecast after a day of `arrivals` (the day before the replayed one),
    observed per poll as the pool manager does (kept in memory, not in a state dir)."""
    forecasts = Forecasts(None)
    per_poll = max(1, round(poll_s / dt))
    counts = arrivals[: len(arrivals) // per_poll * per_poll].reshape(-1, per_poll).sum(axis=1)
    for i, n in enumerate(counts.tolist()):
        forecasts.observe("p", n, BASE_EPOCH - DAY_S + i * per_poll * dt)
    return forecasts


def full_policy(
    cfg: AutoscaleConfig,
    start: int,
    forecasts: Forecasts,
    history: list[ColdStartSample],
    capacity: tuple[int, float],
) -> Callable[[World, float], int]:
    """hpcserve's decide with what the pool manager adds: the modelled capacity, the
    forecast one measured cold start ahead, the schedule floors raised by it, scale to zero
    (the router's unserved demand: a request queued with no replica serving)."""
    state = AutoscaleState(target=start)
    seen = 0
    samples = list(history)
    logged = 0

    def policy(world: World, now: float) -> int:
        nonlocal state, seen, logged
        epoch = BASE_EPOCH + now
        arrivals, seen = world.arrived - seen, world.arrived
        forecasts.observe("p", arrivals, epoch)
        for ready, wait, load in world.cold_log[logged:]:
            if ready > now:
                break
            samples.append(ColdStartSample(0, wait, load, BASE_EPOCH + ready))
            logged += 1
        est = estimate(samples[-KEEP:])
        lead = est.total_p90_s if est is not None else 0.0
        sig = signals(world, now)
        busy = world.in_service or world.queued
        floor, why = scheduled_floor(cfg.schedule, datetime.fromtimestamp(epoch), lead)
        sig = replace(
            sig,
            capacity=capacity[0],
            capacity_rps=capacity[1],
            capacity_source="replay",
            rate_rps=forecasts.rate("p"),
            forecast_rps=forecasts.forecast("p", epoch, lead),
            forecast_horizon_s=lead,
            floor=floor,
            floor_reason=why,
            idle_s=0.0 if busy else now - max(world.last_arrival, 0.0),
            unserved_age_s=0.0 if world.queued and not world.serving(now) else None,
        )
        decision = decide(cfg, sig, state, now)
        state = decision.state
        return decision.target

    return policy


def reactive_policy(
    target_waiting: float,
    lo: int,
    hi: int,
    start: int,
    period_s: float = 15.0,
    stabilise_s: float = 300.0,
    with_running: bool = False,
) -> Callable[[World, float], int]:
    """Kubernetes' HPA on the mean of vllm:num_requests_waiting per pod (what a KEDA
    ScaledObject on that metric sets up), with its defaults: every 15 s, desired =
    ceil(current x mean / target) within a 10% tolerance, starting pods counted as 0 (as
    HPA counts not-ready pods on a scale-up), at most doubling (or +4) per period, and a
    5-minute scale-down stabilisation (the largest recommendation of the window).
    with_running: the metric is running + waiting (vLLM's requests in the engine)."""
    history: deque[tuple[float, int]] = deque()
    current, last = start, -math.inf

    def policy(world: World, now: float) -> int:
        nonlocal current, last
        if now - last < period_s:
            return current
        last = now
        pods = max(world.size(), 1)
        queue = world.queued + (world.in_service if with_running else 0)
        ratio = (queue / pods) / target_waiting
        want = current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)
        want = min(max(want, lo), hi, max(2 * current, current + 4))
        history.append((now, want))
        while history and history[0][0] < now - stabilise_s:
            history.popleft()
        current = want if want > current else max(w for _, w in history)
        return current

    return policy


def static_policy(n: int) -> Callable[[World, float], int]:
    return lambda world, now: n


def plot(
    series: dict[str, list[tuple[float, float, int, int, float]]], names: list[str], out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, reps, ttft) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    first = series[names[0]]
    load.plot([r[0] for r in first], [r[1] for r in first], color="black", lw=0.8)
    load.set_ylabel("arrivals (req/s)")
    for name in names:
        rows = series[name]
        hours = [r[0] for r in rows]
        reps.step(hours, [r[3] for r in rows], where="post", label=name, lw=1)
        ttft.plot(hours, [max(r[4], 0.1) for r in rows], label=name, lw=0.8)
    reps.set_ylabel("replicas holding GPUs")
    reps.legend(fontsize=8)
    ttft.axhline(SLO_TTFT_S, color="red", ls="--", lw=0.8)
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT p95 per minute (s)")
    ttft.set_xlabel("hour of the day")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def policies_for(
    args: argparse.Namespace,
    peak_n: int,
    avg_n: int,
    forecasts: Forecasts,
    history: list[ColdStartSample],
) -> list[tuple[str, Callable[[World, float], int], int]]:
    """The policies compared: static, reactive (HPA/KEDA), hpcserve's queue rules alone,
    and hpcserve with the forecast, schedule and (rare trace) scale to zero."""
    # The planner's figures: a full batch in flight, and the requests/s it finishes (the
    # autoscaler adds the queueing margin, autoscale.queueing_margin).
    capacity = (args.slots, args.slots / args.service_s)

    def full(name: str, cfg: AutoscaleConfig, start: int) -> tuple[str, Any, int]:
        return name, full_policy(cfg, start, copy.deepcopy(forecasts), history, capacity), start

    if args.trace == "rare":
        return [
            ("static, one replica", static_policy(1), 1),
            ("reactive: running + waiting (HPA/KEDA, min 1)",
             reactive_policy(round(args.slots * 0.75), 1, args.max, 1, with_running=True), 1),
            full("hpcserve: forecast, min 1", AutoscaleConfig(min=1, max=args.max), 1),
            full("hpcserve: forecast, scale to zero (min 0, idle_s 900)",
                 AutoscaleConfig(min=0, max=args.max, idle_s=900), 1),
        ]  # fmt: skip
    weekday_floor = [ScheduleFloor(start="09:00", end="17:30", min=max(1, round(peak_n * 0.4)),
                                   days=["mon", "tue", "wed", "thu", "fri"])]  # fmt: skip
    hpc = AutoscaleConfig(min=1, max=args.max, target_in_flight=args.slots)
    return [
        (f"static for the peak ({peak_n})", static_policy(peak_n), peak_n),
        (f"static for the average ({avg_n})", static_policy(avg_n), avg_n),
        ("reactive: waiting per replica (HPA/KEDA, target 2)",
         reactive_policy(2, 1, args.max, 1), 1),
        (f"reactive: running + waiting (HPA/KEDA, target {round(args.slots * 0.75)})",
         reactive_policy(round(args.slots * 0.75), 1, args.max, 1, with_running=True), 1),
        ("hpcserve: queue rules only (reactive)", hpcserve_policy(hpc, 1), 1),
        full("hpcserve: forecast ahead of the measured cold start", hpc, 1),
        full("hpcserve: forecast + warm_spares 1", msgspec.structs.replace(hpc, warm_spares=1), 1),
        full(f"hpcserve: forecast + weekday floor {weekday_floor[0].min} (09:00-17:30)",
             msgspec.structs.replace(hpc, schedule=weekday_floor), 1),
    ]  # fmt: skip


def run_seed(args: argparse.Namespace, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    steps = round(args.days * DAY_S / args.dt)
    shape = rare_rate if args.trace == "rare" else rate
    lam = np.array([shape(i * args.dt, args.peak_rps) * args.dt for i in range(steps)])
    arrivals = np.random.default_rng(seed).poisson(lam)
    day = lam[: round(DAY_S / args.dt)]
    if args.novel_bursts:  # yesterday had no bursts: today's are news to the profile
        day = np.array(
            [args.peak_rps * day_profile(i * args.dt) * args.dt for i in range(len(day))]
        )
    yesterday = np.random.default_rng(seed + 10_000).poisson(day)
    forecasts = learned_forecasts(yesterday, args.dt, args.poll_s)
    per_replica_rps = args.slots / args.service_s
    mean_rps, max_rps = float(lam.mean() / args.dt), float(lam.max() / args.dt)
    peak_n = math.ceil(max_rps / per_replica_rps / 0.9)
    avg_n = max(1, math.ceil(mean_rps / per_replica_rps / 0.9))
    lo_s, hi_s = (float(x) for x in args.load_s.split(","))
    past = random.Random(seed + 20_000)  # cold starts of the days before, as measured
    history = [
        ColdStartSample(0, past.expovariate(1 / args.queue_wait_s), past.uniform(lo_s, hi_s), 0.0)
        for _ in range(KEEP)
    ]
    rows = []
    for name, policy, start in policies_for(args, peak_n, avg_n, forecasts, history):
        cold_rng = random.Random(seed)  # the same cold starts for every policy

        def cold(r: random.Random = cold_rng) -> tuple[float, float]:
            return r.expovariate(1 / args.queue_wait_s), r.uniform(lo_s, hi_s)

        result = run_policy(policy, arrivals, cold, args, start)
        rows.append({"policy": name, "seed": seed, **result})
        print(f"seed {seed} {name}: { {k: v for k, v in result.items() if k != 'series'} }",
              file=sys.stderr)  # fmt: skip
    return rows, {"mean_rps": round(mean_rps, 2), "max_rps": round(max_rps, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--days", type=float, default=1.0)
    ap.add_argument("--dt", type=float, default=0.25, help="simulation step (s)")
    ap.add_argument("--peak-rps", type=float, default=20.0, help="requests/s at the humps")
    ap.add_argument("--trace", choices=["day", "rare"], default="day")
    ap.add_argument(
        "--novel-bursts",
        action="store_true",
        help="the day the profile learns from has no bursts (default: the same bursts)",
    )
    ap.add_argument("--slots", type=int, default=16, help="sequences per replica")
    ap.add_argument("--service-s", type=float, default=6.0, help="decode time per request")
    ap.add_argument("--prefill-s", type=float, default=0.15)
    ap.add_argument("--queue-wait-s", type=float, default=60.0, help="mean Slurm queue wait")
    ap.add_argument("--load-s", default="60,180", help="staging + load, uniform MIN,MAX (s)")
    ap.add_argument("--poll-s", type=float, default=5.0)
    ap.add_argument("--max", type=int, default=40, help="autoscaled pools' max replicas")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--seeds", type=int, default=1, help="days replayed (seed, seed+1, ...)")
    ap.add_argument("--name", default="autoscale_replay")
    ap.add_argument("--plot", default="", help="PNG of load, replicas and TTFT p95 over the day")
    args = ap.parse_args()
    started = time.monotonic()
    runs = [run_seed(args, args.seed + i) for i in range(args.seeds)]
    first, rates = runs[0]
    if args.plot:
        series = {row["policy"]: row["series"] for row in first}
        names = [first[i]["policy"] for i in ((0, 1, 3) if args.trace == "rare" else (0, 3, 4, 5))]
        plot(series, names, Path(args.plot))
    rows = []
    for i, row in enumerate(first):  # each policy's median over the seeds
        mine = [run[0][i] for run in runs]
        peak = [run[0][0]["gpu_hours"] for run in runs]
        p95s = [r["ttft_p95_s"] for r in mine]
        rows.append({
            "policy": row["policy"],
            "gpu_hours": statistics.median(r["gpu_hours"] for r in mine),
            "gpu_hours_vs_first": statistics.median(
                r["gpu_hours"] / p for r, p in zip(mine, peak, strict=True)),
            "slo_attainment": statistics.median(r["slo_attainment"] for r in mine),
            "slo_attainment_min": min(r["slo_attainment"] for r in mine),
            "ttft_p95_s": None if None in p95s else statistics.median(p95s),  # type: ignore[type-var]
            "utilisation": statistics.median(r["utilisation"] for r in mine),
            "changes": statistics.median(r["changes"] for r in mine),
            "requests": statistics.median(r["requests"] for r in mine),
        })  # fmt: skip
    table = []
    for row in rows:
        table.append({
            "policy": row["policy"],
            "GPU-hours": round(row["gpu_hours"], 1),
            f"vs {rows[0]['policy'].split(' (')[0]}": round(row["gpu_hours_vs_first"], 3),
            "TTFT <= 0.8 s": f"{row['slo_attainment']:.2%}",
            "worst seed": f"{row['slo_attainment_min']:.2%}",
            "TTFT p95 (s)": "-" if row["ttft_p95_s"] is None else round(row["ttft_p95_s"], 2),
            "GPU utilisation": f"{row['utilisation']:.0%}",
            "scaling changes": row["changes"],
        })  # fmt: skip
    print_table(table)
    raw = [{k: v for k, v in r.items() if k != "series"} for run in runs for r in run[0]]
    write_results(
        args.name,
        {"rows": table, "medians": rows, "raw": raw},
        {
            "trace": args.trace, "novel_bursts": args.novel_bursts, "days": args.days,
            "dt_s": args.dt, "peak_rps": args.peak_rps,
            **rates, "slots": args.slots, "service_s": args.service_s,
            "prefill_s": args.prefill_s, "queue_wait_mean_s": args.queue_wait_s,
            "load_s": args.load_s, "poll_s": args.poll_s, "seed": args.seed,
            "seeds": args.seeds, "wall_s": round(time.monotonic() - started, 1),
        },
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
