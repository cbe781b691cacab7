"""Routing quality on the simulated fleet: kv-aware against least-load and round-robin.

For each workload (doc-extraction: many users sharing long per-customer contexts;
multi-turn: low reuse, each session's own growing prefix; system-prompt: one shared
system prompt) and each policy, a fresh simulated fleet (bench/simfleet.py: the real
router and gateway, REPLICAS simulated vLLM engines publishing KV events) serves the same
open-loop workload (bench/workload.py). Reported: prefix-cache hit rate (cached prompt
tokens / prompt tokens, from usage) and the oracle's (one infinite cache, in 16-token
blocks, same request order), TTFT p50/p90, output tokens/s, and the largest share of
requests one replica took. With ``--repetitions N`` every cell runs N times, each
repetition with its own workload seed (the same for every policy), policies interleaved.

    .venv/bin/python bench/router_quality.py [--replicas 8] [--requests 200] [--rate 8] \
        [--repetitions 3] [--suffix 64]

Writes bench/results/router_quality[-SUFFIX].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from bench.simfleet import sim_stack  # noqa: E402
from bench.workload import SLO, build, run_workload, summarize  # noqa: E402

BLOCK = 16


def oracle_hit_rate(token_lists: list[list[int]]) -> float:
    """Hit rate of one infinite prefix cache of BLOCK-token blocks, requests in order."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for tokens in token_lists:
        total += len(tokens)
        full = len(tokens) // BLOCK
        matched = True
        for i in range(full):
            key = tuple(tokens[: (i + 1) * BLOCK])
            if matched and key in seen:
                hits += BLOCK
            else:
                matched = False
            seen.add(key)
    return hits / total if total else 0.0


def replica_shares(urls: list[str]) -> list[float]:
    counts = []
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        counts.append(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total")
            )
        )
    total = sum(counts) or 1.0
    return [c / total for c in counts]


def write_trace(engine_trace: Path, specs: list, results: list, tokenizer: object) -> None:
    """Join each request's client measurement with its engine's record (by prompt ids)
    into requests-*.jsonl beside the engines' trace, in arrival order."""
    by_prompt: dict[int, dict] = {}
    if engine_trace.exists():
        for line in engine_trace.read_text().splitlines():
            record = json.loads(line)
            by_prompt[record.pop("prompt_hash")] = record
    out = engine_trace.with_name(engine_trace.name.replace("engines-", "requests-", 1))
    with out.open("w") as f:
        for spec, result in zip(specs, results, strict=True):
            key = hash(tuple(tokenizer.chat_ids(spec.messages)))  # type: ignore[attr-defined]
            engine = by_prompt.get(key, {})
            f.write(
                json.dumps(
                    {
                        "at_s": spec.at_s,
                        "group": spec.group,
                        "client_ttft_s": result.ttft_s,
                        "lateness_s": result.lateness_s,
                        "cached_reported": result.cached_tokens,
                        **engine,
                    }
                )
                + "\n"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--workloads", default="doc-extraction,multi-turn,system-prompt")
    ap.add_argument("--policies", default="kv-aware,least-load,round-robin")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--repetitions", type=int, default=1)
    ap.add_argument("--suffix", default="", help="results file suffix")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a policy to compare by name in --policies, as its base policy (NAME up to "
        'a "+") with more router.routing keys: --variant \'kv-aware+p={"pending_ttl_s": 1}\'',
    )
    ap.add_argument(
        "--trace",
        default="",
        help="a directory: one JSON line per request and cell (client TTFT, the replica, "
        "its cached tokens and what the replica was doing when the request arrived)",
    )
    ap.add_argument(
        "--routing",
        default="{}",
        help='other router.routing keys, JSON: {"tokens_per_request": 128}',
    )
    args = ap.parse_args()
    args.variants = {}
    for item in args.variant:
        name, sep, keys = item.partition("=")
        if not sep or "+" not in name:
            ap.error(f"--variant {item!r}: expected NAME+LABEL=JSON")
        args.variants[name] = json.loads(keys)
    rows = []
    policies = args.policies.split(",")
    cells = [
        (workload, rep, policy)
        for workload in args.workloads.split(",")
        for rep in range(args.repetitions)
        for policy in policies[rep % len(policies) :] + policies[: rep % len(policies)]
    ]
    oracles: dict[tuple[str, int], float] = {}
    for workload, rep, policy in cells:
        for attempt in (1, 2):  # a stack that fails to start (a port taken) gets one retry
            try:
                row = run_cell(args, workload, rep, policy, oracles)
                break
            except (TimeoutError, RuntimeError) as err:
                print(f"{workload} {rep + 1} {policy}: attempt {attempt} failed: {err}", flush=True)
        else:
            continue
        rows.append(row)
        name = "router_quality" + (f"-{args.suffix}" if args.suffix else "")
        write_results(name, {"rows": rows})  # after every cell: a failed run keeps the rest


def run_cell(
    args: argparse.Namespace,
    workload: str,
    rep: int,
    policy: str,
    oracles: dict[tuple[str, int], float],
) -> dict:
    engine_trace = None
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        engine_trace = Path(args.trace) / f"engines-{workload}-{rep + 1}-{policy}.jsonl"
        engine_trace.unlink(missing_ok=True)
    with sim_stack(
        args.replicas,
        policy=policy.partition("+")[0],
        routing=json.loads(args.routing) | args.variants.get(policy, {}),
        time_scale=args.time_scale,
        sim_args=["--request-trace", str(engine_trace)] if engine_trace else None,
    ) as stack:
        specs = build(
            workload,
            model=stack.model,
            rate=args.rate,
            requests=args.requests,
            seed=rep + 1,
            count_tokens=stack.count_tokens,
        )
        if (workload, rep) not in oracles:
            stack.count_tokens("")  # loads the tokenizer
            oracles[workload, rep] = oracle_hit_rate(
                [stack._tokenizer.chat_ids(s.messages) for s in specs]
            )
        oracle = oracles[workload, rep]
        results = asyncio.run(
            run_workload(specs, stack.base_url, model=stack.model, api_key=stack.api_key)
        )
        summary = summarize(results, SLO(ttft_s=0.5, tpot_s=0.05))
        shares = replica_shares(stack.replica_urls)
        if engine_trace is not None:
            write_trace(engine_trace, specs, results, stack._tokenizer)
    row = {
        "workload": workload,
        "repetition": rep + 1,
        "policy": policy,
        "oracle_hit_rate": oracle,
        "max_replica_share": max(shares),
        **asdict(summary),
    }
    print(
        f"| {workload} | {rep + 1} | {policy} | {summary.cached_share:.1%} | {oracle:.1%} | "
        f"{summary.ttft_p50_s * 1e3:.0f} ms | {summary.ttft_p90_s * 1e3:.0f} ms | "
        f"{summary.output_tps:.0f} | {max(shares):.0%} | {summary.ok}/{summary.requests} |",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
