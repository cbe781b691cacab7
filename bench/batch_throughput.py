"""Batch API throughput against the engines' own maximum, and interactive TTFT while a batch
runs against idle: side by side in one run, on one set of engines.

An extraction-like workload: N chat requests in F document families; each family shares a
long instruction prefix (system message), each request adds its own short document and
asks for a fixed number of output tokens. Phases, in this order, on the same engines:

  direct       every request straight to the engines (round robin, `--direct-concurrency`
               per replica): the engines' maximum tokens/s
  idle         interactive streamed chat requests through the gateway at `--probe-rate`/s,
               nothing else running: TTFT p50/p90
  batch        the same N requests as one batch through the gateway's Batch API, while the
               same interactive probes run: batch tokens/s (create -> completed, as a client
               sees it) and the probes' TTFT p50/p90

Engines: `--engine sim` starts a simulated fleet (hpcserve.sim.fleet: continuous batching,
roofline timing of `--sim-model` on `--sim-gpu`, `--time-scale` wall s per modelled s);
`--engine vllm-cpu` starts real vLLM CPU engines on a tiny model (slow to start: minutes).

Pools: by default the `--replicas` engines are one pool that serves both the batch and the
probes. `--interactive-replicas K` makes them a batch pool (pools[].role "batch") and starts
K more engines as an interactive pool of the same model (a second fleet process for sim):
the router sends the batch to the batch pool and the probes to the interactive pool, and
the direct phase drives the batch pool's engines. The engines' CPU use is reported per
pool, so a simulator that is itself the bottleneck shows.

    .venv/bin/python bench/batch_throughput.py --requests 10000 --replicas 4
    .venv/bin/python bench/batch_throughput.py --requests 10000 --replicas 4 \
        --interactive-replicas 1 --time-scale 4
    .venv/bin/python bench/batch_throughput.py --engine vllm-cpu --replicas 1 --requests 200 \
        --prefix-words 200 --doc-words 40 --max-tokens 32

Prints a markdown table and writes bench/results/batch_throughput-<engine>[-<tag>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.config import dump_config, hash_api_key, parse_config  # noqa: E402
from hpcserve.router.client import list_replicas  # noqa: E402
from tests.ports import free_port  # noqa: E402

KEY = "sk-bench-batch"
MODEL = "extract"
WORDS = [
    "consignee", "shipper", "notify", "party", "port", "loading", "discharge", "vessel",
    "voyage", "container", "seal", "weight", "gross", "net", "package", "marks", "numbers",
    "description", "goods", "freight", "prepaid", "collect", "invoice", "customs", "tariff",
    "origin", "declaration", "incoterm", "value", "currency", "quantity", "unit",
]  # fmt: skip


def family_prefix(family: int, words: int) -> str:
    rng = random.Random(family)
    return f"Family {family} extraction rules. " + " ".join(rng.choice(WORDS) for _ in range(words))


def requests_of(args: argparse.Namespace) -> list[dict[str, Any]]:
    prefixes = [family_prefix(f, args.prefix_words) for f in range(args.families)]
    rng = random.Random(1234)
    out = []
    for i in range(args.requests):
        document = f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(args.doc_words))
        out.append(
            {
                "model": MODEL,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": prefixes[i % args.families]},
                    {"role": "user", "content": document},
                ],
            }
        )
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Stack:
    """Router, engines and gateway as separate processes on loopback."""

    def __init__(self, args: argparse.Namespace, state: Path) -> None:
        self.args = args
        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        registry, routing = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.routing = routing
        self.registry = registry
        self.config_path = state / "hpcserve.toml"
        self.write_config(args.batch_concurrency[0])
        self.procs: list[subprocess.Popen[bytes]] = []
        self.engines: list[subprocess.Popen[bytes]] = []
        self.interactive_engines: list[subprocess.Popen[bytes]] = []
        self.gateway: subprocess.Popen[bytes] | None = None

    def write_config(self, batch_concurrency: str) -> None:
        args, state = self.args, self.state
        registry, routing = self.registry, self.routing
        config = parse_config({
            "state_dir": str(state),
            "router": {"registry_bind": registry, "routing_bind": routing, "metrics_port": 0,
                       "routing": {"batch_lend_below": args.lend_below}},
            "gateway": {"port": self.port, "upstream_timeout_s": 3600,
                        "api_keys": [{"tenant": "bench", "sha256": hash_api_key(KEY)}]},
            "pools": self.pools(),
            "batch": {**batch_bound(batch_concurrency),
                      "max_lines": max(50_000, args.requests),
                      "max_file_bytes": 2 * 1024 * 1024 * 1024},
        })  # fmt: skip
        self.config_path.write_text(dump_config(config))

    def pools(self) -> list[dict[str, Any]]:
        """The pools' config: one shared pool, or a batch pool and an interactive pool."""
        pool = {"model_path": "/nonexistent", "engine": "sim", "served_model_name": MODEL,
                "scheduling_policy": self.args.scheduling_policy}  # fmt: skip
        if not self.args.interactive_replicas:
            return [{**pool, "name": MODEL}]
        return [{**pool, "name": f"{MODEL}-batch", "role": "batch"}, {**pool, "name": MODEL}]

    @property
    def split(self) -> bool:
        return self.args.interactive_replicas > 0

    def _spawn(
        self, argv: list[str], name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.state / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        hpcserve = [sys.executable, "-m", "hpcserve.cli"]
        self._spawn([*hpcserve, "router", "--config", str(self.config_path)], "router")
        args = self.args
        batch_role = "batch" if self.split else "interactive"
        pools = [(args.replicas, batch_role, self.engines)]
        if self.split:
            pools.append((args.interactive_replicas, "interactive", self.interactive_engines))
        if args.engine == "sim":
            for replicas, role, procs in pools:
                procs.append(self._spawn(
                    [sys.executable, "-m", "hpcserve.sim.fleet", "--replicas", str(replicas),
                     "--router", self.registry, "--served-model-name", MODEL, "--no-kv-events",
                     "--pool", f"{MODEL}-{role}", "--role", role,
                     "--sim-gpu", args.sim_gpu, "--sim-model", args.sim_model,
                     "--time-scale", str(args.time_scale),
                     "--max-num-seqs", str(args.max_num_seqs),
                     "--default-max-tokens", str(args.max_tokens),
                     "--scheduling-policy", args.scheduling_policy],
                    f"fleet-{role}",
                ))  # fmt: skip
        else:
            from hpcserve.tinymodels import make_tiny_model

            model = make_tiny_model("chat", self.state / "model")
            for replicas, role, procs in pools:
                for i in range(replicas):
                    procs.append(self._spawn(
                        [*hpcserve, "engine", "--engine", "vllm-cpu", "--model-path", str(model),
                         "--served-model-name", MODEL, "--pool", f"{MODEL}-{role}",
                         "--role", role, "--router", self.registry,
                         "--bind-host", "127.0.0.1", "--advertise-host", "127.0.0.1",
                         "--", "--dtype", "float32", "--max-model-len", "2048",
                         "--scheduling-policy", args.scheduling_policy],
                        f"engine-{role}{i}",
                        # Several CPU engines on one machine: not all pinned to core 0.
                        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                             "OMP_NUM_THREADS": "1"},
                    ))  # fmt: skip
        deadline = time.monotonic() + (60 if args.engine == "sim" else 900)
        while len(self.replicas()) < args.replicas + args.interactive_replicas:
            assert time.monotonic() < deadline, "engines did not register in time"
            time.sleep(0.5)
        self.start_gateway()

    def restart_gateway(self, batch_concurrency: str) -> None:
        assert self.gateway is not None
        self.gateway.terminate()
        self.gateway.wait(30)
        self.write_config(batch_concurrency)
        self.start_gateway()

    def start_gateway(self) -> None:
        hpcserve = [sys.executable, "-m", "hpcserve.cli"]
        self.gateway = self._spawn(
            [*hpcserve, "gateway", "--config", str(self.config_path)], "gateway"
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                import urllib.request

                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.2)

    def engine_cpu_s(self, interactive: bool = False) -> float:
        """CPU seconds of the (batch pool's, or interactive pool's) engine processes and
        all their descendants (vLLM's API server, engine core and worker under the engine)."""
        total = 0.0
        pids = [proc.pid for proc in (self.interactive_engines if interactive else self.engines)]
        while pids:
            pid = pids.pop()
            with contextlib.suppress(OSError):
                total += cpu_seconds(pid)
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pids += [int(c) for c in (task / "children").read_text().split()]
        return total

    def replicas(self, role: str = "") -> list[str]:
        try:
            return [r.url for r in list_replicas(self.routing) if not role or r.role == role]
        except Exception:
            return []

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def batch_bound(concurrency: str) -> dict[str, Any]:
    """The [batch] keys of one --batch-concurrency value: "adaptive" (the default config) or
    a fixed number per replica."""
    if concurrency == "adaptive":
        return {"adaptive_concurrency": True}
    return {"concurrency_per_replica": int(concurrency), "adaptive_concurrency": False}


async def batch_limits(url: str) -> dict[str, float]:
    """The gateway's batch bound per replica of each model now (adapted or fixed)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    prefix = "hpcserve_batch_concurrency_per_replica{"
    return {
        line.split('model="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct(replicas: list[str], bodies: list[dict[str, Any]], per_replica: int) -> dict:
    queues: list[list[bytes]] = [[] for _ in replicas]
    for i, body in enumerate(bodies):
        queues[i % len(replicas)].append(json.dumps(body).encode())
    tokens = [0, 0]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker(url: str, queue: list[bytes]) -> None:
            while queue:
                body = queue.pop()
                async with session.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as response:
                    usage = (await response.json())["usage"]
                    tokens[0] += usage["prompt_tokens"]
                    tokens[1] += usage["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(
            *(
                worker(url, queue)
                for url, queue in zip(replicas, queues, strict=True)
                for _ in range(per_replica)
            )
        )
        wall = time.perf_counter() - started
    return {
        "seconds": wall,
        "input_tokens": tokens[0],
        "output_tokens": tokens[1],
        "tokens_per_s": sum(tokens) / wall,
    }


def has_content(line: bytes) -> bool:
    if not line.startswith(b"data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def probe(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    started = time.perf_counter()
    async with session.post(
        url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    ) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if has_content(line):
                ttft = time.perf_counter() - started
                break
        else:
            raise AssertionError("stream ended before its first token")
        async for _ in response.content:
            pass
    return ttft


async def probes(url: str, rate: float, stop: asyncio.Event, count: int | None) -> list[float]:
    """Open-loop interactive requests at `rate`/s until stop is set (or `count` are sent)."""
    body = json.dumps(
        {
            "model": MODEL,
            "max_tokens": 16,
            "stream": True,
            "messages": [{"role": "user", "content": "Where is container MSCU 4711 now?"}],
        }
    ).encode()
    results: list[float] = []
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        sent = 0
        while not stop.is_set() and (count is None or sent < count):
            tasks.append(asyncio.create_task(probe(session, url, body)))
            sent += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / rate)
        results = list(await asyncio.gather(*tasks))
    return results


async def run_batch(stack: Stack, bodies: list[dict[str, Any]], rate: float) -> dict:
    data = b"".join(
        json.dumps(
            {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        ).encode()
        + b"\n"
        for i, b in enumerate(bodies)
    )
    headers = {"Authorization": f"Bearer {KEY}"}
    assert stack.gateway is not None
    async with aiohttp.ClientSession(headers=headers) as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="extract.jsonl")
        async with session.post(stack.url + "/v1/files", data=form) as response:
            upload = await response.json()
            assert response.status == 200, upload
        cpu_before = cpu_seconds(stack.gateway.pid)
        started = time.perf_counter()
        async with session.post(
            stack.url + "/v1/batches",
            json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions",
                  "completion_window": "24h"},
        ) as response:  # fmt: skip
            batch = await response.json()
            assert response.status == 200, batch
        stop = asyncio.Event()
        ttfts = asyncio.create_task(probes(stack.url, rate, stop, None))
        bounds: dict[str, list[float]] = {}  # the batch bound per replica, every 2 s
        polls = 0
        while True:
            async with session.get(f"{stack.url}/v1/batches/{batch['id']}") as response:
                batch = await response.json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.25)
            polls += 1
            if polls % 8:
                continue  # the gateway's /metrics costs it milliseconds: not every poll
            limits = await batch_limits(stack.url)
            for model, limit in limits.items():
                bounds.setdefault(model, []).append(limit)
        wall = time.perf_counter() - started
        cpu = cpu_seconds(stack.gateway.pid) - cpu_before
        stop.set()
        probe_ttfts = await ttfts
    usage = batch["usage"]
    return {
        "status": batch["status"],
        "request_counts": batch["request_counts"],
        "seconds": wall,
        "input_tokens": usage["input_tokens"],
        "output_tokens": usage["output_tokens"],
        "tokens_per_s": usage["total_tokens"] / wall,
        "gateway_cpu_s": cpu,
        "ttft": probe_ttfts,
        "bound_per_replica": bounds.get(MODEL, []),
    }


def summary(ttfts: list[float]) -> dict[str, float]:
    return {
        "n": len(ttfts),
        "p50_ms": 1000 * statistics.median(ttfts),
        "p90_ms": 1000 * percentile(ttfts, 0.9),
    }


async def engine_counters(replicas: list[str]) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
              "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_sum",
              "vllm:time_to_first_token_seconds_count")  # fmt: skip
    totals = dict.fromkeys(wanted, 0.0)
    async with aiohttp.ClientSession() as session:
        for url in replicas:
            async with session.get(url + "/metrics") as response:
                for line in (await response.text()).splitlines():
                    name = line.split("{", 1)[0].split(" ", 1)[0]
                    if name in totals:
                        totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


class Phase:
    """Engine CPU use and prefix-cache hits over one phase, and the interactive pool's
    engine-side TTFT (the engines' own histogram: queue + prefill, no network or gateway)."""

    def __init__(self, stack: Stack, replicas: list[str]) -> None:
        self.stack, self.replicas = stack, replicas
        self.interactive = stack.replicas("interactive") if stack.split else []

    async def __aenter__(self) -> Phase:
        self.cpu = self.stack.engine_cpu_s()
        self.interactive_cpu = self.stack.engine_cpu_s(interactive=True)
        self.router_cpu = cpu_seconds(self.stack.procs[0].pid)
        self.counters = await engine_counters(self.replicas)
        self.interactive_counters = await engine_counters(self.interactive)
        self.started = time.perf_counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.started
        counters = await engine_counters(self.replicas)
        ttft = await engine_counters(self.interactive)
        ttft_n = (
            ttft["vllm:time_to_first_token_seconds_count"]
            - self.interactive_counters["vllm:time_to_first_token_seconds_count"]
        )
        ttft_s = (
            ttft["vllm:time_to_first_token_seconds_sum"]
            - self.interactive_counters["vllm:time_to_first_token_seconds_sum"]
        )
        # The simulator's histograms are in modelled seconds: x time scale is wall time.
        scale = self.stack.args.time_scale if self.stack.args.engine == "sim" else 1.0
        queries = (
            counters["vllm:prefix_cache_queries_total"]
            - self.counters["vllm:prefix_cache_queries_total"]
        )
        hits = (
            counters["vllm:prefix_cache_hits_total"] - self.counters["vllm:prefix_cache_hits_total"]
        )
        self.result = {
            "engine_cpu_util": (self.stack.engine_cpu_s() - self.cpu) / wall,
            "interactive_engine_cpu_util": (
                self.stack.engine_cpu_s(interactive=True) - self.interactive_cpu
            )
            / wall,
            "router_cpu_util": (cpu_seconds(self.stack.procs[0].pid) - self.router_cpu) / wall,
            "loadavg": os.getloadavg(),
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "preemptions": counters["vllm:num_preemptions_total"]
            - self.counters["vllm:num_preemptions_total"],
            "interactive_engine_ttft_mean_ms": 1000 * scale * ttft_s / ttft_n if ttft_n else None,
        }


async def bench(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    bodies = requests_of(args)
    # The engines the batch runs on: the batch pool's when there is one.
    replicas = stack.replicas("batch" if stack.split else "")
    directs = []
    for concurrency in args.direct_concurrency:
        async with Phase(stack, replicas) as phase:
            run = await direct(replicas, bodies, concurrency)
        run.update(phase.result)
        run["concurrency_per_replica"] = concurrency
        directs.append(run)
        print(
            f"direct at {concurrency}/replica: {run['tokens_per_s']:,.0f} tokens/s", file=sys.stderr
        )
    direct_run = max(directs, key=lambda r: r["tokens_per_s"])
    async with Phase(stack, replicas) as idle_phase:
        idle = await probes(stack.url, args.probe_rate, asyncio.Event(), args.idle_probes)
    print(f"idle probes: p90 {summary(idle)['p90_ms']:.1f} ms", file=sys.stderr)
    batches = []
    for i, concurrency in enumerate(args.batch_concurrency):
        if i:
            stack.restart_gateway(concurrency)
        async with Phase(stack, replicas) as phase:
            batch = await run_batch(stack, bodies, args.probe_rate)
        batch.update(phase.result)
        batch["concurrency_per_replica"] = concurrency
        batch["ttft_ms"] = [round(1000 * t, 2) for t in batch["ttft"]]  # in sending order
        batch["ttft"] = summary(batch["ttft"])
        print(
            f"batch at {concurrency}/replica: {batch['tokens_per_s']:,.0f} tokens/s, "
            f"TTFT p90 {batch['ttft']['p90_ms']:.1f} ms",
            file=sys.stderr,
        )
        batches.append(batch)
    return {
        "direct": direct_run,
        "directs": directs,
        "idle_ttft": summary(idle),
        "idle_ttft_ms": [round(1000 * t, 2) for t in idle],
        "idle_phase": idle_phase.result,
        "batches": batches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["sim", "vllm-cpu"], default="sim")
    parser.add_argument(
        "--replicas", type=int, default=4, help="the batch's engines (the batch pool, if split)"
    )
    parser.add_argument(
        "--interactive-replicas",
        type=int,
        default=0,
        help="> 0: the --replicas engines are a batch pool and these an interactive pool",
    )
    parser.add_argument(
        "--lend-below",
        type=int,
        default=0,
        help="router.routing.batch_lend_below: batch may borrow idle interactive replicas",
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=2_900)
    parser.add_argument("--doc-words", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--sim-gpu", default="h100")
    parser.add_argument("--sim-model", default="llama-3.1-8b")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--direct-concurrency",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[32, 64, 128, 256],
        help="per replica; a comma list runs the direct phase per value, the best is the maximum",
    )
    parser.add_argument(
        "--batch-concurrency",
        type=lambda text: text.split(","),
        default=["adaptive"],
        help="'adaptive' (the default config: the bound adapts to the engines' queues) or a "
        "fixed batch.concurrency_per_replica; a comma list runs one batch per value",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=["priority", "fcfs"],
        default="priority",
        help="the engines' (vLLM's --scheduling-policy; the pools' default is priority)",
    )
    parser.add_argument("--probe-rate", type=float, default=2.0, help="interactive req/s")
    parser.add_argument("--idle-probes", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tag", default="", help="results file suffix: ...-<engine>-<tag>.json")
    args = parser.parse_args()
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
            stack = Stack(args, Path(tmp))
            try:
                stack.start()
                rounds.append(asyncio.run(bench(args, stack)))
            finally:
                stack.stop()

    def med(values: list[float]) -> float:
        return statistics.median(values)

    direct_tps = med([r["direct"]["tokens_per_s"] for r in rounds])
    idle_p50 = med([r["idle_ttft"]["p50_ms"] for r in rounds])
    idle_p90 = med([r["idle_ttft"]["p90_ms"] for r in rounds])
    table = []
    for i, concurrency in enumerate(args.batch_concurrency):
        runs = [r["batches"][i] for r in rounds]
        tps = med([b["tokens_per_s"] for b in runs])
        p50 = med([b["ttft"]["p50_ms"] for b in runs])
        p90 = med([b["ttft"]["p90_ms"] for b in runs])
        table.append(
            {
                "concurrency_per_replica": concurrency,
                "batch_tokens_per_s": tps,
                "share_of_direct": tps / direct_tps,
                "ttft_p50_ms": p50,
                "ttft_p90_ms": p90,
                "ttft_p90_vs_idle": p90 / idle_p90 - 1,
                "gateway_cpu_s": med([b["gateway_cpu_s"] for b in runs]),
                "engine_cpu_util": med([b["engine_cpu_util"] for b in runs]),
                "interactive_engine_cpu_util": med(
                    [b["interactive_engine_cpu_util"] for b in runs]
                ),
                # the bound per replica the batch ran at: median and last (adaptive: adapted)
                "bound_median": med([med(b["bound_per_replica"] or [0]) for b in runs]),
                "bound_last": med([(b["bound_per_replica"] or [0])[-1] for b in runs]),
            }
        )
    best = rounds[0]["direct"]["concurrency_per_replica"]
    rows = [
        {"run": f"direct, {best}/replica (the maximum)", "tokens_per_s": round(direct_tps),
         "of_direct": 1.0, "ttft_p50_ms": round(idle_p50, 1), "ttft_p90_ms": round(idle_p90, 1),
         "ttft_p90_vs_idle": 0.0},
        *(
            {"run": f"batch, {row['concurrency_per_replica']}/replica",
             "tokens_per_s": round(row["batch_tokens_per_s"]),
             "of_direct": round(row["share_of_direct"], 3),
             "ttft_p50_ms": round(row["ttft_p50_ms"], 1),
             "ttft_p90_ms": round(row["ttft_p90_ms"], 1),
             "ttft_p90_vs_idle": round(row["ttft_p90_vs_idle"], 2)}
            for row in table
        ),
    ]  # fmt: skip
    result = {
        "rows": rows,
        "args": vars(args),
        "rounds": rounds,
        "median": {
            "direct_tokens_per_s": direct_tps,
            "direct_engine_cpu_util": med([r["direct"]["engine_cpu_util"] for r in rounds]),
            "idle_ttft_p50_ms": idle_p50,
            "idle_ttft_p90_ms": idle_p90,
            "batches": table,
        },
    }
    print(
        "| direct concurrency per replica | tokens/s | batch engines' CPU (cores) |\n|---|---|---|"
    )
    for run in rounds[0]["directs"]:
        print(
            f"| {run['concurrency_per_replica']} | {run['tokens_per_s']:,.0f} "
            f"| {run['engine_cpu_util']:.2f} |"
        )
    print(
        f"\ndirect (engines' maximum, at {best}/replica): {direct_tps:,.0f} tokens/s; "
        f"interactive TTFT idle: "
        f"p50 {idle_p50:.1f} ms, p90 {idle_p90:.1f} ms\n"
    )
    print("| batch concurrency per replica | bound (median, last) | batch tokens/s | of direct "
          "| TTFT p50 | TTFT p90 | p90 vs idle | gateway CPU "
          "| engines' CPU (batch, interactive) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(
            f"| {row['concurrency_per_replica']} "
            f"| {row['bound_median']:.0f}, {row['bound_last']:.0f} "
            f"| {row['batch_tokens_per_s']:,.0f} "
            f"| {row['share_of_direct']:.1%} | {row['ttft_p50_ms']:.1f} ms "
            f"| {row['ttft_p90_ms']:.1f} ms | {row['ttft_p90_vs_idle']:+.0%} "
            f"| {row['gateway_cpu_s']:.1f} s "
            f"| {row['engine_cpu_util']:.2f}, {row['interactive_engine_cpu_util']:.2f} |"
        )
    tag = f"-{args.tag}" if args.tag else ""
    out = write_results(f"batch_throughput-{args.engine}{tag}", result)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
