"""The batch at which a replica's TPOT p95 reaches the SLO: measured from what its heartbeats
carry (poolmgr/batch_limit.py) against the truth of the engine it measures, and against the
capacity planner's figure.

The engine is the simulator's (sim/pd.py: the simulated vLLM scheduler with continuous
batching and chunked prefill over a KV cache, each step priced by the planner's roofline, in
modelled time): one replica, a mix of request shapes, Poisson arrivals at a ladder of rates
from 10% to 100% of the planner's figure, one run per rate, the runs back to back as one
replica's day. What a pool manager would see every `--poll-s` of it is built from the
requests' times: the running count (requests between first scheduled and last token) and the
cumulative TPOT histogram in vLLM's buckets with its sum; BatchLimits measures from those.

The truth: per run, its steady part's (sim/pd.py `latencies`: less the first 20% and the last
10% of its requests) time-averaged batch and TPOT p95 (every request's mean token gap, as
vLLM's histogram counts it); the batch at the SLO lies between the last run within it and the
first beyond it (interpolated). The model: the planner's batch for the mix's mean shape
(poolmgr/autoscale_capacity.py `modelled`), what the autoscaler carries without a
measurement. Both figures are a limit on the batch at an instant; the autoscaler keeps a
replica's mean load under one with its queueing margin (a + 1.5 sqrt(a) slots), so "runs
at" is the mean load one replica alone is sized for with each: the figure to hold against
the truth, a run's mean batch at which its p95 reaches the SLO.

    .venv/bin/python bench/batch_limit_accuracy.py [--seconds 240] [--poll-s 5] [--seeds 3]

Medians over the seeds (each seed draws every run's arrivals).

Writes bench/results/batch_limit_accuracy.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.config import parse_config  # noqa: E402
from hpcserve.contracts.protocol import LatencyHistogram, ReplicaInfo, ReplicaLoad  # noqa: E402
from hpcserve.planner import Factors  # noqa: E402
from hpcserve.planner.pd import parse_mix  # noqa: E402
from hpcserve.poolmgr.autoscale_capacity import modelled  # noqa: E402
from hpcserve.poolmgr.batch_limit import BatchLimits  # noqa: E402
from hpcserve.sim.pd import Layout, Outcome, PDRun, latencies, poisson_arrivals  # noqa: E402
from hpcserve.sim.scheduler import SchedulerLimits  # noqa: E402
from hpcserve.sim.timing import hardware  # noqa: E402

# vLLM's buckets for vllm:request_time_per_output_token_seconds (sim/metrics.py ITL_BUCKETS).
BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
           10.0, 20.0, 40.0, 80.0]  # fmt: skip
RATE_SHARES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
TPOT_SLO_S, TTFT_SLO_S = 0.05, 0.8
# name: (GPU, model, mix PROMPT:OUTPUT:SHARE)
CASES = {
    "chat on L40S": ("l40s", "llama-3.1-8b", "800:250:0.7,2000:400:0.3"),
    "documents on L40S": ("l40s", "llama-3.1-8b", "3500:150:0.5,1000:300:0.5"),
    "chat on A100": ("a100", "llama-3.1-8b", "800:250:0.7,2000:400:0.3"),
}


def finish_s(o: Outcome) -> float:
    return o.arrival_s + o.ttft_s + sum(o.gaps)


def steady_batch(outcomes: list[Outcome]) -> float:
    """The time-averaged running requests (first scheduled to last token: vLLM's
    num_requests_running) over the run's steady part (the requests `latencies` keeps: the
    first 20% and last 10% by arrival left out)."""
    ordered = sorted(outcomes, key=lambda o: o.arrival_s)
    kept = ordered[int(len(ordered) * 0.2) : len(ordered) - int(len(ordered) * 0.1)]
    t0, t1 = kept[0].arrival_s, kept[-1].arrival_s
    busy = sum(max(0.0, min(finish_s(o), t1) - max(o.scheduled_s, t0)) for o in ordered)
    return busy / (t1 - t0)


def polls(runs: list[list[Outcome]], poll_s: float) -> list[tuple[float, int, LatencyHistogram]]:
    """What one replica's heartbeats show every poll_s over the runs back to back: (time,
    running, cumulative TPOT histogram with its sum)."""
    offset, events = 0.0, []
    for outcomes in runs:
        for o in outcomes:
            events.append((offset + o.scheduled_s, offset + finish_s(o), o.tpot_s))
        offset += max(finish_s(o) for o in outcomes) + 1.0
    started = sorted(a for a, _, _ in events)
    done = sorted((f, tpot) for _, f, tpot in events)
    finishes = [f for f, _ in done]
    out, counts, total, summed, i = [], [0] * len(BUCKETS), 0, 0.0, 0
    t = poll_s
    while t < offset:
        while i < len(done) and done[i][0] <= t:
            tpot = done[i][1]
            if tpot >= 0:  # a one-token answer has no TPOT (vLLM observes none)
                total += 1
                summed += tpot
                for j, bound in enumerate(BUCKETS):
                    if tpot <= bound:
                        counts[j] += 1
            i += 1
        running = bisect.bisect_right(started, t) - bisect.bisect_right(finishes, t)
        out.append((t, running, LatencyHistogram(list(BUCKETS), list(counts), total, summed)))
        t += poll_s
    return out


def load_at(capacity: float, margin: float) -> float:
    """The mean in flight one replica alone is sized to run at with this capacity: the
    largest a with a + margin x sqrt(a) <= capacity (poolmgr/autoscale.py replicas_for)."""
    root = (-margin + math.sqrt(margin * margin + 4 * capacity)) / 2
    return root * root


def truth(points: list[tuple[float, float]]) -> float | None:
    """The batch where TPOT p95 crosses the SLO, between the runs either side (by batch)."""
    ordered = sorted(points)
    for (b0, p0), (b1, p1) in itertools.pairwise(ordered):
        if p0 <= TPOT_SLO_S < p1:
            return b0 + (b1 - b0) * (TPOT_SLO_S - p0) / (p1 - p0)
    return None


def case(
    name: str, gpu: str, model: str, mix_text: str, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    mix = parse_mix(mix_text)
    total = sum(s.share for s in mix)
    prompt = round(sum(s.prompt * s.share for s in mix) / total)
    output = round(sum(s.output * s.share for s in mix) / total)
    pool = parse_config({"pools": [{
        "name": "p", "model_path": "/m", "replicas": 1,
        "autoscale": {"max": 8, "ttft_p95_s": TTFT_SLO_S, "tpot_p95_s": TPOT_SLO_S,
                      "capacity": {"model": model, "gpu": gpu, "prompt_tokens": prompt,
                                   "output_tokens": output}},
    }]}).pools[0]  # fmt: skip
    model_cap = modelled(pool)
    assert model_cap.requests_per_s is not None
    factors = Factors()
    hw = hardware(gpu, model)
    limits = SchedulerLimits(factors.max_num_seqs, factors.max_num_batched_tokens)
    runs, ladder = [], []
    started = time.perf_counter()
    for share in RATE_SHARES:
        rate = model_cap.requests_per_s * share
        count = max(200, int(rate * args.seconds))
        result = PDRun(hw, limits, Layout(1)).run(poisson_arrivals(mix, rate, count, seed=seed))
        lat = latencies(result)
        batch = steady_batch(result.outcomes)
        ladder.append({"rate_rps": round(rate, 3), "batch": round(batch, 2),
                       "tpot_p95_ms": round(lat.tpot_p95_s * 1e3, 2),
                       "growing": lat.growing})  # fmt: skip
        runs.append(result.outcomes)
    true_batch = truth([(r["batch"], r["tpot_p95_ms"] / 1e3) for r in ladder if not r["growing"]])
    limits_seen = BatchLimits(window_s=float("inf"))
    for t, running, hist in polls(runs, args.poll_s):
        info = ReplicaInfo(replica_id="r1", model="m", url="http://n:1", pool="p",
                           slurm_job_id=1, node="n", age_s=1, last_seen_age_s=0, in_flight=running,
                           load=ReplicaLoad(running=running, tpot=hist))  # fmt: skip
        limits_seen.observe("p", [info], t)
    limit = limits_seen.measured("p", TPOT_SLO_S)
    margin = pool.autoscale.queueing_margin if pool.autoscale else 0.0
    carried = limit.capacity(model_cap.in_flight) if limit else model_cap.in_flight
    return {
        "case": name,
        "seed": seed,
        "gpu": gpu,
        "model": model,
        "mix": mix_text,
        "ladder": ladder,
        "truth_batch": round(true_batch, 1) if true_batch is not None else None,
        "measured_low": round(limit.low, 1) if limit else None,
        "measured_high": round(limit.high, 1) if limit else None,
        "measured": limit.describe() if limit else None,
        "measured_carried": carried,
        "measured_runs_at": round(load_at(carried, margin), 1),
        "model_batch": model_cap.in_flight,
        "model_runs_at": round(load_at(model_cap.in_flight, margin), 1),
        "model_source": model_cap.source,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=240.0,
                        help="modelled seconds of arrivals per rate")  # fmt: skip
    parser.add_argument("--poll-s", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    runs = [case(name, *spec, seed, args) for name, spec in CASES.items()
            for seed in range(args.seeds)]  # fmt: skip
    rows = []
    print("| case | mean batch at the SLO, truth | measured: carried, runs at (/ truth) | "
          "the model's: carried, runs at (/ truth) |")  # fmt: skip
    print("|---|---|---|---|")
    for name in CASES:
        mine = [r for r in runs if r["case"] == name and r["truth_batch"] is not None]
        med = {key: statistics.median(r[key] for r in mine)
               for key in ("truth_batch", "measured_carried", "measured_runs_at",
                           "model_batch", "model_runs_at")}  # fmt: skip
        rows.append({"case": name, "seeds": len(mine), **med})
        t = med["truth_batch"]
        print(f"| {name} | {t:.1f} | {med['measured_carried']:.0f}, {med['measured_runs_at']:.1f} "
              f"({med['measured_runs_at'] / t:.2f}x) | {med['model_batch']:.0f}, "
              f"{med['model_runs_at']:.1f} ({med['model_runs_at'] / t:.2f}x) |")  # fmt: skip
    for r in runs:
        print(f"\n{r['case']} seed {r['seed']}: {r['measured']}; model: {r['model_source']}")
        for step in r["ladder"]:
            print(f"  {step}")
    write_results("batch_limit_accuracy", {"medians": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
