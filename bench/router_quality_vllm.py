"""Routing quality on real vLLM CPU engines: kv-aware against least-load and round-robin.

Three replicas of a tiny chat model (hpcserve.tinymodels), each started as the engine agent
starts them (`hpcserve engine --engine vllm-cpu`: KV events on, prefix caching on,
`--enforce-eager`) with a small KV cache (`--num-gpu-blocks-override`), so that where a
prefix lands decides whether it stays cached. The engines start once per invocation and
serve every policy and repetition; between runs the router and the gateway are restarted
with the next policy and every engine's prefix cache is reset (vLLM's dev-mode
POST /reset_prefix_cache, which publishes AllBlocksCleared to the router).

Workloads (bench/workload.py), sized for 2 CPU cores, short outputs:
- ``doc-extraction`` (a): many users sharing long per-customer contexts;
- ``multi-turn`` (b): low reuse, each session's own growing prefix;
- ``system-prompt`` (c): one shared system prompt;
- ``capacity`` (the placement failure): long per-customer contexts that all begin with the
  same short preamble, so a capacity-blind prefix router piles new contexts onto the
  replica holding the preamble; ``kv-blind`` (kv-aware with the KV-pressure term off) is
  its baseline, ``kv-approx`` (kv-aware without KV events: the router remembers what it
  routed where) the stale-state one.

Reported per run: prefix-cache hit rate from vLLM's own counters
(vllm:prefix_cache_hits_total / queries_total, deltas over the run, summed over the
replicas), the oracle's hit rate (one infinite cache of the engines' 128-token blocks,
requests in order, the last prompt token never a hit, as vLLM counts), its ratio, TTFT
p50/p90 (client side, through the gateway), output tokens/s, and each replica's share of
the requests (vllm:request_success_total deltas). From the router's /metrics: the hit rate
its prefix index predicted for the replicas it chose (stale state, prefixes the engine
evicted, would show as a prediction above the engines' count) and the BlockRemoved blocks
it applied.

    flock /tmp/hpcserve-heavy.lock .venv/bin/python bench/router_quality_vllm.py \\
        --workloads doc-extraction --repetitions 3

Writes bench/results/router_quality_vllm[-SUFFIX].json and prints a markdown table.
`--engine sim` runs the same harness on simulated engines (seconds; for checking it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_wait import wait_http  # noqa: E402
from bench.results import load_average, write_results  # noqa: E402
from bench.workload import (  # noqa: E402
    SLO,
    Lengths,
    RequestSpec,
    build,
    make_text,
    run_workload,
    summarize,
)
from hpcserve.config import dump_config, hash_api_key, parse_config  # noqa: E402
from hpcserve.contracts.router_client import list_replicas  # noqa: E402
from hpcserve.sim.tokenizer import load_tokenizer  # noqa: E402
from hpcserve.tinymodels import make_tiny_model  # noqa: E402
from tests.ports import free_ports  # noqa: E402
from tests.services import stop  # noqa: E402

API_KEY = "sk-router-quality-vllm"
MODEL = "tiny-chat"
BLOCK = 128  # vLLM CPU's block size

# Workload parameters (bench/workload.py) per named workload; sized so a run takes ~30 s.
SHORT_OUTPUT = Lengths("fixed", mean=8)
WORKLOADS: dict[str, dict[str, Any]] = {
    "doc-extraction": dict(document_tokens=1000, customers=12, output=SHORT_OUTPUT),
    "multi-turn": dict(
        sessions=12, turns=5, query=Lengths("lognormal", mean=96, low=16, high=256),
        output=SHORT_OUTPUT,
    ),
    "system-prompt": dict(system_tokens=1000, output=SHORT_OUTPUT),
    "capacity": dict(
        document_tokens=1200, customers=12, zipf_s=0.0, preamble_tokens=300,
        output=SHORT_OUTPUT,
    ),
}  # fmt: skip


def oracle_hit_rate(token_lists: list[list[int]], block: int = BLOCK) -> float:
    """Hit rate of one infinite prefix cache of ``block``-token blocks, requests in order,
    counted as vLLM counts: full blocks only, never the prompt's last token."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for tokens in token_lists:
        total += len(tokens)
        matched = True
        for i in range(max(len(tokens) - 1, 0) // block):
            key = tuple(tokens[: (i + 1) * block])
            if matched and key in seen:
                hits += block
            else:
                matched = False
            seen.add(key)
    return hits / total if total else 0.0


def engine_counters(url: str) -> dict[str, float]:
    """The vLLM counters this benchmark reads, from one engine's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {"hits": 0.0, "queries": 0.0, "requests": 0.0}
    names = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:request_success_total": "requests",
    }
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


ROUTER_SERIES = {
    "hpcserve_router_prompt_tokens_total": "prompt_tokens",
    "hpcserve_router_cached_prompt_tokens_total": "predicted_cached_tokens",
    "hpcserve_router_kv_blocks_stored_total": "blocks_stored",
    "hpcserve_router_kv_blocks_removed_total": "blocks_removed",
}


def router_counters(port: int, token_file: Path) -> dict[str, float]:
    """What the router's index predicted (cached tokens on the chosen replica) and the KV
    events it applied, from its /metrics (which asks for the metrics token)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics",
        headers={"Authorization": f"Bearer {token_file.read_text().strip()}"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(ROUTER_SERIES.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ROUTER_SERIES:
            out[ROUTER_SERIES[name]] += float(line.rsplit(" ", 1)[1])
    return out


def reset_prefix_cache(url: str) -> None:
    for _ in range(50):
        try:
            req = urllib.request.Request(url + "/reset_prefix_cache", b"", method="POST")
            urllib.request.urlopen(req, timeout=10).close()
            return
        except urllib.error.HTTPError:
            time.sleep(0.2)  # blocks still held by a finishing request
    raise RuntimeError(f"{url}/reset_prefix_cache kept failing")


@dataclass
class Fleet:
    """Engines that outlive the router and gateway restarts between policies."""

    work: Path
    model_dir: Path
    registry: str
    routing: str
    gateway_port: int
    router_metrics_port: int
    engine: str
    engine_args: list[str]
    engine_urls: list[str]

    def config(self, policy: str, routing: dict[str, Any]) -> Path:
        raw: dict[str, Any] = {
            "state_dir": str(self.work / "state"),
            "router": {
                "registry_bind": self.registry,
                "routing_bind": self.routing,
                "metrics_port": self.router_metrics_port,
                "allow_plain_loopback": True,  # one user's benchmark; engines hold no keys
                "routing": {"policy": policy, **routing},
            },
            "gateway": {
                "port": self.gateway_port,
                "api_keys": [{"tenant": "bench", "sha256": hash_api_key(API_KEY)}],
            },
            "pools": [
                {
                    "name": MODEL,
                    "model_path": str(self.model_dir),
                    "engine": self.engine,
                    "engine_args": self.engine_args,
                    "replicas": len(self.engine_urls),
                }
            ],
        }
        path = self.work / f"hpcserve-{policy}.toml"
        path.write_text(dump_config(parse_config(raw)))
        return path


def _spawn(stack: contextlib.ExitStack, log: Path, argv: list[str], **kw: Any) -> Any:
    out = log.open("ab")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **kw)
    stack.callback(out.close)
    stack.callback(stop, proc, 60)
    return proc


def _wait_replicas(routing: str, n: int, procs: list[Any], timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    listed: list[Any] = []
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:4]} exited ({proc.returncode})")
        with contextlib.suppress(Exception):
            listed = list_replicas(routing, timeout_s=1.0)
        if len(listed) >= n:
            return listed
        time.sleep(0.5)
    raise TimeoutError(f"{len(listed)} of {n} replicas registered after {timeout_s:g}s")


@contextlib.contextmanager
def control_plane(fleet: Fleet, policy: str, routing: dict[str, Any]) -> Iterator[str]:
    """Router (with ``policy``) and gateway; waits until every engine has re-registered."""
    config = fleet.config(policy, routing)
    hpcserve = [sys.executable, "-m", "hpcserve.cli"]
    with contextlib.ExitStack() as stack:
        router = _spawn(
            stack, fleet.work / "router.log", [*hpcserve, "router", "--config", str(config)]
        )
        _wait_replicas(fleet.routing, len(fleet.engine_urls), [router], 60)
        gateway = _spawn(
            stack, fleet.work / "gateway.log", [*hpcserve, "gateway", "--config", str(config)]
        )
        base = f"http://127.0.0.1:{fleet.gateway_port}"
        wait_http(base + "/health", 60)
        assert gateway.poll() is None
        yield base


@contextlib.contextmanager
def engines(args: argparse.Namespace, work: Path) -> Iterator[Fleet]:
    model_dir = work / f"{MODEL}-{args.size}"
    if not (model_dir / "config.json").exists():
        make_tiny_model("chat", model_dir, size=args.size)
    engine_args = ["--max-model-len", str(args.max_model_len)]
    engine_args += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    if args.engine == "vllm-cpu":
        engine_args += ["--dtype", "float32", "--enforce-eager"]
    else:
        engine_args += ["--block-size", str(BLOCK)]
    # Kept for the whole run while the router and gateway restart per policy: from below
    # the ephemeral range, where no outgoing connection takes them between two runs.
    registry, routing, gateway, metrics = free_ports(4)
    fleet = Fleet(
        work=work,
        model_dir=model_dir,
        registry=f"tcp://127.0.0.1:{registry}",
        routing=f"tcp://127.0.0.1:{routing}",
        gateway_port=gateway,
        router_metrics_port=metrics,
        engine=args.engine,
        engine_args=engine_args,
        engine_urls=[],
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between runs
        # Three engines on a small machine: no pinning to one core, one thread each.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    with contextlib.ExitStack() as stack:
        # A router for the engines to register with while they start (vLLM takes minutes).
        config = fleet.config("kv-aware", {})
        hpcserve = [sys.executable, "-m", "hpcserve.cli"]
        started = time.monotonic()
        procs = []
        for i in range(args.replicas):
            argv = [
                *hpcserve, "engine", "--model-path", str(model_dir),
                "--served-model-name", MODEL, "--pool", MODEL, "--router", fleet.registry,
                "--engine", args.engine, "--bind-host", "127.0.0.1",
                "--advertise-host", "127.0.0.1", "--ready-timeout-s", "1200",
                "--", *engine_args,
            ]  # fmt: skip
            procs.append(_spawn(stack, work / f"engine-{i}.log", argv, env=env))
        with contextlib.ExitStack() as first:
            router = _spawn(
                first, work / "router.log", [*hpcserve, "router", "--config", str(config)]
            )
            listed = _wait_replicas(fleet.routing, args.replicas, [router, *procs], 1500)
        fleet.engine_urls = sorted(r.url for r in listed)
        print(
            f"{args.replicas} {args.engine} engines ready in {time.monotonic() - started:.0f} s: "
            f"{', '.join(fleet.engine_urls)}",
            flush=True,
        )
        yield fleet


def workload_specs(name: str, args: argparse.Namespace, seed: int, count: Any) -> list[RequestSpec]:
    params = dict(WORKLOADS[name])
    preamble = params.pop("preamble_tokens", 0)
    base = "doc-extraction" if name == "capacity" else name
    specs = build(
        base,
        model=MODEL,
        rate=args.rate,
        requests=args.requests,
        seed=seed,
        count_tokens=count,
        **params,
    )
    if preamble:
        # Every customer's context starts with the same instructions (a few blocks).
        text = "Instructions: " + make_text(preamble, random.Random(99), count) + "\n"
        specs = [
            RequestSpec(
                s.at_s,
                [{**s.messages[0], "content": text + s.messages[0]["content"]}, *s.messages[1:]],
                s.max_tokens,
                s.group,
            )
            for s in specs
        ]
    return specs


def run_one(
    fleet: Fleet, policy: str, routing: dict[str, Any], specs: list[RequestSpec]
) -> dict[str, Any]:
    for url in fleet.engine_urls:
        reset_prefix_cache(url)
    with control_plane(fleet, policy, routing) as base:
        before = [engine_counters(u) for u in fleet.engine_urls]
        results = asyncio.run(run_workload(specs, base, model=MODEL, api_key=API_KEY))
        failed = [r for r in results if not r.ok]
        if failed:
            print(f"{len(failed)} requests failed, e.g. {failed[0]}", file=sys.stderr, flush=True)
        time.sleep(0.5)  # the last request's counters
        after = [engine_counters(u) for u in fleet.engine_urls]
        router = router_counters(
            fleet.router_metrics_port, fleet.work / "state" / "secrets" / "metrics-token"
        )
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    hits = sum(d["hits"] for d in delta)
    queries = sum(d["queries"] for d in delta)
    served = [d["requests"] for d in delta]
    summary = summarize(results, SLO(ttft_s=1.0, tpot_s=0.1))
    return {
        "hit_rate": hits / queries if queries else 0.0,
        # The index's prediction for the replicas it chose: stale state (prefixes the engine
        # evicted) shows as a prediction above the engines' own count.
        "predicted_hit_rate": router["predicted_cached_tokens"] / (router["prompt_tokens"] or 1),
        "router": router,
        "replica_share": [s / (sum(served) or 1) for s in served],
        "summary": asdict(summary),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="doc-extraction,multi-turn,system-prompt")
    ap.add_argument("--policies", default="kv-aware,least-load,round-robin")
    ap.add_argument(
        "--capacity-policies",
        default="kv-aware,kv-blind,kv-approx,round-robin",
        help="the policies of the capacity workload",
    )
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--engine", default="vllm-cpu", choices=["vllm-cpu", "sim"])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--kv-blocks", type=int, default=48, help="KV blocks of 128 per replica")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--routing", default="{}", help="other router.routing keys, JSON")
    ap.add_argument("--work", default="/tmp/hpcserve-router-quality-vllm")
    ap.add_argument("--suffix", default="", help="results file suffix")
    args = ap.parse_args()
    # A SIGTERM stops the engines too (the ExitStacks unwind on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    routing = json.loads(args.routing)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    meta = {
        "load_average_start": load_average(),
        "engine": args.engine,
        "model_size": args.size,
        "kv_blocks_per_replica": args.kv_blocks,
        "block_size": BLOCK,
    }
    rows: list[dict[str, Any]] = []
    print("| workload | rep | policy | hit rate | oracle | of oracle | TTFT p50 | TTFT p90 "
          "| output tok/s | per-replica share | index predicted | blocks removed | ok |",
          flush=True)  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    with engines(args, work) as fleet:
        tokenizer = load_tokenizer(str(fleet.model_dir))

        def count(text: str) -> int:
            return len(tokenizer.prompt_ids(text))

        for workload in args.workloads.split(","):
            chosen = args.capacity_policies if workload == "capacity" else args.policies
            policies = chosen.split(",")
            for rep in range(args.repetitions):
                specs = workload_specs(workload, args, seed=rep + 1, count=count)
                oracle = oracle_hit_rate([tokenizer.chat_ids(s.messages) for s in specs])
                order = policies[rep % len(policies) :] + policies[: rep % len(policies)]
                for policy in order:
                    # An operator sets the replicas' KV capacity (here known: the override).
                    name, extra = policy, {"kv_capacity_tokens": args.kv_blocks * BLOCK}
                    extra |= routing
                    if policy == "kv-blind":  # kv-aware without the KV-capacity term
                        name, extra = "kv-aware", {**extra, "kv_pressure_weight": 0.0}
                    if policy == "kv-approx":  # no KV events: what was routed where, TTL'd
                        name, extra = "kv-aware", {**extra, "kv_events": False}
                    out = run_one(fleet, name, extra, specs)
                    s = out["summary"]
                    row = {
                        "workload": workload,
                        "repetition": rep + 1,
                        "policy": policy,
                        "hit_rate": out["hit_rate"],
                        "predicted_hit_rate": out["predicted_hit_rate"],
                        "blocks_removed": out["router"]["blocks_removed"],
                        "oracle_hit_rate": oracle,
                        "of_oracle": out["hit_rate"] / oracle if oracle else 0.0,
                        "max_replica_share": max(out["replica_share"]),
                        "replica_share": out["replica_share"],
                        "load_average": load_average(),
                        **s,
                    }
                    rows.append(row)
                    shares = " / ".join(f"{x:.0%}" for x in out["replica_share"])
                    print(
                        f"| {workload} | {rep + 1} | {policy} | {row['hit_rate']:.1%} | "
                        f"{oracle:.1%} | {row['of_oracle']:.0%} | "
                        f"{s['ttft_p50_s'] * 1e3:.0f} ms | {s['ttft_p90_s'] * 1e3:.0f} ms | "
                        f"{s['output_tps']:.1f} | {shares} | {row['predicted_hit_rate']:.1%} | "
                        f"{row['blocks_removed']:.0f} | {s['ok']}/{s['requests']} |",
                        flush=True,
                    )
    name = "router_quality_vllm" + (f"-{args.suffix}" if args.suffix else "")
    write_results(name, {"rows": rows}, meta)


if __name__ == "__main__":
    main()
