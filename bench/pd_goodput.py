"""Disaggregated prefill/decode vs colocated replicas: the planner's goodput against the sim's.

For each case (a request mix and a reading of the TPOT SLO) the planner (hpcserve/planner/
pd.py) predicts the goodput of N colocated replicas and proposes a prefill:decode split of
the same N; the simulated fleet (sim/pd.py: the simulator's scheduler and KV cache per
replica, the planner's roofline per step, in modelled time) then finds each layout's
goodput: the largest Poisson arrival rate whose steady-state TTFT p95 and TPOT p95 meet the
SLO, by bisection between half and one and a half times the planner's figure.

Cases (llama-3.1-8b on H100, TP 1, KV over 400 Gb/s InfiniBand, TTFT p95 < 800 ms and
TPOT p95 < 50 ms):

- ``long-mean``: half document extraction (3,000-token prompts, 150 out), half chat
  (400 in, 150 out); TPOT is each request's mean token gap, as bench/workload.py counts it.
- ``long-token``: the same mix; TPOT is every token gap (ITL p95): a stall of one step
  counts.
- ``short-mean``: chat only (200 in, 150 out), where the planner predicts PD does not pay.

    .venv/bin/python bench/pd_goodput.py [--replicas 4] [--seeds 3] [--steps 4] [--seconds S]

A run is steady-state p95s over its requests less the first 20% and last 10% (sim/pd.py
``latencies``), and fails when its queue still grows at the end. Each case's runs cover
30 s of arrivals (chat: 12 s) unless --seconds says otherwise.

Writes bench/results/pd_goodput.json with one row per case and layout: the planner's
goodput, the simulated one (median over seeds) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.planner import MODELS, Factors, Replica, Roofline, get_gpu, memory_fit  # noqa: E402
from hpcserve.planner.pd import LINKS, Engine, PDComparison, compare, parse_mix  # noqa: E402
from hpcserve.planner.replica import kv_bytes_per_token  # noqa: E402
from hpcserve.sim.pd import Layout, PDRun, latencies, poisson_arrivals  # noqa: E402
from hpcserve.sim.scheduler import SchedulerLimits  # noqa: E402
from hpcserve.sim.timing import hardware  # noqa: E402

MODEL, GPU, LINK = "llama-3.1-8b", "h100", "ib"
TTFT_S, TPOT_S = 0.8, 0.05
# name: (mix, TPOT read per token, modelled seconds of arrivals per run). The chat case runs
# ~400 requests/s: its runs are shorter (each still ~5 request lifetimes).
CASES = {
    "long-mean": ("3000:150:0.5,400:150:0.5", False, 30.0),
    "long-token": ("3000:150:0.5,400:150:0.5", True, 30.0),
    "short-mean": ("200:150", False, 12.0),
}


def sim_goodput(
    meets: Callable[[float], bool], predicted: float, steps: int
) -> tuple[float, float, int]:
    """The largest rate ``meets``, bisected in [0.5, 1.5] x ``predicted`` (widened when the
    answer lies outside); (the last rate that met, the lowest that did not, runs)."""
    low, high, runs = 0.5 * predicted, 1.5 * predicted, 0
    while not meets(low):
        runs += 1
        high, low = low, low / 2
        if low < predicted / 64:
            return 0.0, low * 2, runs
    runs += 1
    while meets(high):
        runs += 1
        low, high = high, high * 1.5
    runs += 1
    for _ in range(steps):
        mid = (low + high) / 2
        runs += 1
        if meets(mid):
            low = mid
        else:
            high = mid
    return low, high, runs


def measure(
    layout: Layout,
    mix_text: str,
    per_token: bool,
    predicted: float,
    seconds: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The simulated goodput of ``layout`` (median over seeds), against the prediction."""
    factors = Factors()
    hw = hardware(GPU, MODEL)
    limits = SchedulerLimits(factors.max_num_seqs, factors.max_num_batched_tokens)
    mix = parse_mix(mix_text)
    found, failed, runs = [], [], 0
    prompt_tokens = {"decode": 0, "all": 0}
    for seed in range(args.seeds):

        def meets(rate: float, seed: int = seed) -> bool:
            count = max(200, int(rate * seconds))
            result = PDRun(hw, limits, layout).run(poisson_arrivals(mix, rate, count, seed=seed))
            prompt_tokens["decode"] += result.prompt_tokens_by_role.get("decode", 0)
            prompt_tokens["all"] += sum(result.prompt_tokens_by_role.values())
            return latencies(result).meets(TTFT_S, TPOT_S, per_token=per_token)

        rate, fails_at, n = sim_goodput(meets, predicted, args.steps)
        found.append(rate)
        failed.append(fails_at)
        runs += n
    sim = statistics.median(found)
    return {
        "layout": layout.label,
        "planner_rps": round(predicted, 1),
        "sim_rps": round(sim, 1),
        # The bisection's bracket: the goodput lies between sim_rps and this (medians).
        "sim_fails_at_rps": round(statistics.median(failed), 1),
        "sim_over_planner": round(sim / predicted, 2) if predicted else None,
        "seeds": args.seeds,
        "runs": runs,
        # Prompt tokens the decode replicas computed (1 per request: the last prompt token,
        # for its logits, as vLLM's connector does) over all prompt tokens computed.
        "decode_prompt_share": round(prompt_tokens["decode"] / max(prompt_tokens["all"], 1), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4, help="GPUs (TP 1), both layouts")
    ap.add_argument("--seeds", type=int, default=1, help="arrival sequences; medians over them")
    ap.add_argument("--seconds", type=float, help="modelled arrivals per run (the case's)")
    ap.add_argument("--steps", type=int, default=4, help="bisection steps per search")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd_goodput.json"))
    args = ap.parse_args()

    factors = Factors()
    replica = Replica(MODELS[MODEL], get_gpu(GPU))
    roofline = Roofline(replica, factors)
    engine = Engine(
        factors.max_num_batched_tokens, factors.max_num_seqs, memory_fit(replica, factors).kv_tokens
    )
    kv_bytes = kv_bytes_per_token(replica.model, "bf16")
    link = LINKS[LINK]
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for case in args.cases.split(","):
        mix_text, per_token, seconds = CASES[case]
        mix = parse_mix(mix_text)
        plan: PDComparison = compare(
            roofline,
            engine,
            mix,
            replicas=args.replicas,
            link=link,
            kv_bytes_per_token=kv_bytes,
            ttft_s=TTFT_S,
            tpot_s=TPOT_S,
            per_token=per_token,
        )
        layouts = [
            (Layout(args.replicas), plan.colocated_rps),
            (Layout(args.replicas, plan.prefill, link, kv_bytes), plan.pd_rps),
        ]
        measured: dict[str, float] = {}
        for layout, predicted in layouts:
            row = measure(layout, mix_text, per_token, predicted, args.seconds or seconds, args)
            measured[layout.label] = row["sim_rps"]
            rows.append({"case": case, **row})
            print(rows[-1], flush=True)
        colo, pd = (measured[layout.label] for layout, _ in layouts)
        rows[-2]["planner_gain"] = rows[-2]["sim_gain"] = None
        rows[-1]["planner_gain"] = round(plan.gain, 2)
        rows[-1]["sim_gain"] = round(pd / colo - 1, 2) if colo else None
    wall = time.monotonic() - started
    setup = {
        "model": MODEL,
        "gpu": GPU,
        "replicas": args.replicas,
        "link": link.name,
        "slo": {"ttft_p95_s": TTFT_S, "tpot_p95_s": TPOT_S},
        "cases": {
            c: {"mix": mix, "per_token": per_token, "seconds_per_run": args.seconds or seconds}
            for c, (mix, per_token, seconds) in CASES.items()
        },
        "wall_s": round(wall, 1),
    }
    out = Path(args.out)
    write_results(out.stem, {"rows": rows, "setup": setup}, directory=out.parent)


if __name__ == "__main__":
    main()
