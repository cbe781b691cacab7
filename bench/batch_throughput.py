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

Pinning (`--batch-cpus`, `--interactive-cpus`, `--control-cpus`, CPU lists): each pool's
engine process trees may run only on their CPUs (sched_setaffinity, inherited by every
process vLLM starts; vLLM CPU's OMP threads bound there by VLLM_CPU_OMP_THREADS_BIND), and
this client, the router and the gateway on the control CPUs: real CPU engines on one
machine then do not slow each other down, as engines on their own GPUs do not. Each round
records where every thread may run and last ran (`placement`) and stops if a pinning did
not take.

Runner: `--runner process` (the default) runs the batch in `hpcserve batch-runner`, a
process of its own beside the gateway (batch.runner = "process"); `--runner gateway` in
the gateway that also serves the probes (batch.runner = "gateway", as before 2026-11-30
evening); `--runner gateway,process` runs one batch phase with each, side by side in one
round. The runner process runs on `--runner-cpus`, by default the batch engines' CPUs
(`--batch-cpus`): it is batch work, and on the control CPUs it would again take the CPU
the probes' gateway and router need.

Rounds: `--rounds N` repeats everything on fresh processes (direct settings in alternating
order) and reports medians; the engines' maximum is the best direct setting by its median
over the rounds. `--direct-after` drives the engines directly again after the batch, so
each setting's figure brackets the batch. Rounds run as separate invocations (to keep each
under the heavy-run lock's ~15 minutes) combine with `--combine a.json,b.json --tag T`.

    .venv/bin/python bench/batch_throughput.py --requests 10000 --replicas 4
    .venv/bin/python bench/batch_throughput.py --requests 10000 --replicas 4 \
        --interactive-replicas 1 --time-scale 4
    .venv/bin/python bench/batch_throughput.py --engine vllm-cpu --replicas 1 --requests 200 \
        --prefix-words 200 --doc-words 40 --max-tokens 32
    .venv/bin/python bench/batch_throughput.py --engine vllm-cpu --replicas 1 \
        --interactive-replicas 1 --requests 1000 --prefix-words 200 --doc-words 40 \
        --max-tokens 32 --direct-concurrency 32,64,128 --rounds 2 \
        --batch-cpus 0 --interactive-cpus 1 --control-cpus 0

Prints a markdown table and writes bench/results/batch_throughput-<engine>[-<tag>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
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
from hpcserve.config import dump_config, hash_api_key, load_config, parse_config  # noqa: E402
from hpcserve.contracts.router_client import list_replicas  # noqa: E402
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


def requests_of(args: argparse.Namespace, phase: int = 0) -> list[dict[str, Any]]:
    """The workload's requests; each `phase` gets other documents under the same family
    prefixes. Phases that sent the same requests again hit their whole prompts in the
    engines' prefix cache (1,000 of the tiny model's fit in vLLM CPU's), so every phase
    after the first was served from cache and ran up to twice as fast."""
    prefixes = [family_prefix(f, args.prefix_words) for f in range(args.families)]
    rng = random.Random(1234 + 7919 * phase)
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


def parse_cpus(text: str, flag: str, allowed: set[int] | None = None) -> frozenset[int]:
    """A CPU list as taskset and vLLM write it ("0", "2-3", "0,2-3"); "" is no pinning.
    ValueError naming `flag` when malformed or not among the CPUs this process may use."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ValueError(
                f"{flag}: {part!r} is not a CPU number or range (e.g. 0 or 2-3)"
            ) from None
        if first < 0 or last < first:
            raise ValueError(f"{flag}: {part!r} is not an ascending range of CPU numbers")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    if cpus - allowed:
        raise ValueError(
            f"{flag}: CPU {min(cpus - allowed)} is not one this process may use "
            f"({cpu_list(allowed)})"
        )
    return frozenset(cpus)


def cpu_list(cpus: set[int] | frozenset[int]) -> str:
    """The inverse of parse_cpus in /proc's Cpus_allowed_list form: {0, 2, 3} -> "0,2-3"."""
    parts, ordered = [], sorted(cpus)
    for i, cpu in enumerate(ordered):
        if i and cpu == ordered[i - 1] + 1:
            parts[-1][1] = cpu
        else:
            parts.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (every thread's children)."""
    pids, seen = [pid], []
    while pids:
        pid = pids.pop()
        seen.append(pid)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
    return seen


def thread_placement(pids: list[int]) -> dict[str, Any]:
    """Where the threads of the processes `pids` may run (each distinct Cpus_allowed_list,
    with its thread count) and where each last ran (processor: thread count), as
    `ps -eLo pid,psr,comm` shows it."""
    allowed: dict[str, int] = {}
    last_ran: dict[str, int] = {}
    for proc in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{proc}/task").iterdir():
                status = (task / "status").read_text()
                line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
                key = line.split(":", 1)[1].strip()
                allowed[key] = allowed.get(key, 0) + 1
                cpu = (task / "stat").read_text().rsplit(")", 1)[1].split()[36]
                last_ran[cpu] = last_ran.get(cpu, 0) + 1
    return {"cpus_allowed": allowed, "last_ran_on": last_ran}


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
        self.runner_mode = args.runner[0]
        self.runner_metrics_port = free_port()
        self.write_config(args.batch_concurrency[0], self.runner_mode)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: dict[int, str] = {}  # pid: the name of its log (state/<name>.log)
        self.engines: list[subprocess.Popen[bytes]] = []
        self.interactive_engines: list[subprocess.Popen[bytes]] = []
        self.gateway: subprocess.Popen[bytes] | None = None
        self.runner: subprocess.Popen[bytes] | None = None  # `hpcserve batch-runner`

    def write_config(self, batch_concurrency: str, runner: str) -> None:
        args, state = self.args, self.state
        registry, routing = self.registry, self.routing
        config = parse_config({
            "state_dir": str(state),
            "router": {"registry_bind": registry, "routing_bind": routing, "metrics_port": 0,
                       "allow_plain_loopback": True,  # the sim fleet registers without keys
                       "routing": {"batch_lend_below": args.lend_below}},
            "gateway": {"port": self.port, "upstream_timeout_s": 3600,
                        "api_keys": [{"tenant": "bench", "sha256": hash_api_key(KEY)}]},
            "pools": self.pools(),
            "batch": {**batch_bound(batch_concurrency),
                      "runner": runner, "metrics_port": self.runner_metrics_port,
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
        self,
        argv: list[str],
        name: str,
        env: dict[str, str] | None = None,
        cpus: frozenset[int] = frozenset(),
    ) -> subprocess.Popen[bytes]:
        """Start a process; with `cpus`, it and every process it starts may run only there."""
        log = open(self.state / f"{name}.log", "ab")  # noqa: SIM115
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=pin)
        self.procs.append(proc)
        self.names[proc.pid] = name
        return proc

    def pool_cpus(self, role: str) -> frozenset[int]:
        """The CPUs of the batch pool's engines (or the one shared pool's), or the
        interactive pool's."""
        batch = role == "batch" or not self.split
        return self.args.batch_cpus if batch else self.args.interactive_cpus

    def engine_env(self, role: str) -> dict[str, str]:
        """vLLM CPU's threads: pinned to the pool's CPUs (its OMP threads bound one per
        CPU: VLLM_CPU_OMP_THREADS_BIND), or unbound (several engines on one machine would
        otherwise all bind to the same core)."""
        cpus = self.pool_cpus(role)
        if not cpus:
            return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
                "OMP_NUM_THREADS": str(len(cpus))}  # fmt: skip

    def placement(self) -> dict[str, Any]:
        """Where the engines' process trees (per pool) and the control plane (this process,
        router, gateway) may run and last ran; ValueError when a pinning did not take."""
        assert self.gateway is not None
        control = [os.getpid(), *process_tree(self.procs[0].pid), *process_tree(self.gateway.pid)]
        placement = {
            "control": [thread_placement(control)],
            "runner": [thread_placement(process_tree(self.runner.pid))] if self.runner else [],
            "batch": [thread_placement(process_tree(proc.pid)) for proc in self.engines],
            "interactive": [
                thread_placement(process_tree(proc.pid)) for proc in self.interactive_engines
            ],
        }
        for role, cpus in (
            ("control", self.args.control_cpus),
            ("batch", self.args.batch_cpus),
            ("interactive", self.args.interactive_cpus),
            ("runner", self.args.runner_cpus),
        ):
            wrong = {a for tree in placement[role] for a in tree["cpus_allowed"]} - {cpu_list(cpus)}
            if cpus and wrong:
                raise ValueError(f"{role} threads may run on {sorted(wrong)}, not {cpu_list(cpus)}")
        return placement

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
                    cpus=self.pool_cpus(role),
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
                        env=self.engine_env(role),
                        cpus=self.pool_cpus(role),
                    ))  # fmt: skip
        deadline = time.monotonic() + (60 if args.engine == "sim" else 900)
        while len(self.replicas()) < args.replicas + args.interactive_replicas:
            assert time.monotonic() < deadline, "engines did not register in time"
            for proc in self.engines + self.interactive_engines:
                if proc.poll() is not None:  # e.g. its port was taken
                    log = (self.state / f"{self.names[proc.pid]}.log").read_text()
                    raise RuntimeError(
                        f"engine {self.names[proc.pid]} exited with code {proc.returncode} "
                        "before registering; its log ends:\n" + "\n".join(log.splitlines()[-8:])
                    )
            time.sleep(0.5)
        self.start_gateway()

    def restart_gateway(self, batch_concurrency: str, runner: str) -> None:
        """The gateway (and the runner process) again, on a config with these settings."""
        assert self.gateway is not None
        self.gateway.terminate()
        self.gateway.wait(30)
        if self.runner is not None:
            self.runner.terminate()
            self.runner.wait(30)
            self.runner = None
        self.runner_mode = runner
        self.write_config(batch_concurrency, runner)
        self.start_gateway()

    def metrics_headers(self) -> dict[str, str]:
        """What the gateway's /metrics asks for (its metrics token, made at its start)."""
        config = load_config(self.config_path)
        token = Path(config.metrics_token_path()).read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    @property
    def batch_metrics_url(self) -> str:
        """/metrics of the process that runs the batches."""
        if self.runner_mode == "process":
            return f"http://127.0.0.1:{self.runner_metrics_port}/metrics"
        return self.url + "/metrics"

    def start_runner(self) -> None:
        """`hpcserve batch-runner` (batch.runner = "process"), on the runner CPUs."""
        hpcserve = [sys.executable, "-m", "hpcserve.cli"]
        self.runner = self._spawn(
            [*hpcserve, "batch-runner", "--config", str(self.config_path)],
            "batch-runner",
            cpus=self.args.runner_cpus,
        )
        healthz = f"http://127.0.0.1:{self.runner_metrics_port}/healthz"  # open, unlike /metrics
        wait_http(healthz, self.runner, "batch runner")

    def start_gateway(self) -> None:
        hpcserve = [sys.executable, "-m", "hpcserve.cli"]
        self.gateway = self._spawn(
            [*hpcserve, "gateway", "--config", str(self.config_path)], "gateway"
        )
        wait_http(self.url + "/health", self.gateway, "gateway")
        if self.runner_mode == "process":
            self.start_runner()

    def control_cpu_s(self) -> dict[str, float]:
        """CPU seconds of the gateway and of the runner process (0 when there is none)."""
        assert self.gateway is not None
        return {
            "gateway": cpu_seconds(self.gateway.pid),
            "runner": cpu_seconds(self.runner.pid) if self.runner else 0.0,
        }

    def engine_cpu_s(self, interactive: bool = False) -> float:
        """CPU seconds of the (batch pool's, or interactive pool's) engine processes and
        all their descendants (vLLM's API server, engine core and worker under the engine)."""
        total = 0.0
        for proc in self.interactive_engines if interactive else self.engines:
            for pid in process_tree(proc.pid):
                with contextlib.suppress(OSError):
                    total += cpu_seconds(pid)
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


def wait_http(url: str, proc: subprocess.Popen[bytes], name: str, timeout_s: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}") from None
            assert time.monotonic() < deadline, f"{name} did not start"
            time.sleep(0.2)


def batch_bound(concurrency: str) -> dict[str, Any]:
    """The [batch] keys of one --batch-concurrency value: "adaptive" (the default config) or
    a fixed number per replica."""
    if concurrency == "adaptive":
        return {"adaptive_concurrency": True}
    return {"concurrency_per_replica": int(concurrency), "adaptive_concurrency": False}


async def batch_limits(url: str, headers: dict[str, str]) -> dict[str, float]:
    """The runner's batch bound per replica of each model now (adapted or fixed), from the
    /metrics at `url` (the gateway's, which asks for its metrics token, or the runner
    process's)."""
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
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
    """A chunk with the first token: content, or a finish (the tiny random model on vLLM
    sometimes samples its end-of-sequence token first: the stream then ends, content "")."""
    if not line.startswith(b"data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content") or choices[0].get("finish_reason"))


async def probe(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    started = time.perf_counter()
    async with session.post(
        url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    ) as response:
        assert response.status == 200, await response.text()
        lines: list[bytes] = []
        async for line in response.content:
            if has_content(line):
                ttft = time.perf_counter() - started
                break
            lines.append(line)
        else:
            raise AssertionError(f"stream ended before its first token: {lines[-4:]!r}")
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
        cpu_before = stack.control_cpu_s()
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
        placement: dict[str, Any] = {}
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
            limits = await batch_limits(stack.batch_metrics_url, stack.metrics_headers())
            for model, limit in limits.items():
                bounds.setdefault(model, []).append(limit)
            if polls == 8:
                placement = stack.placement()  # under load: where the threads ran
        wall = time.perf_counter() - started
        cpu = {k: v - cpu_before[k] for k, v in stack.control_cpu_s().items()}
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
        "gateway_cpu_s": cpu["gateway"],
        "runner_cpu_s": cpu["runner"],
        "runner": stack.runner_mode,
        "ttft": probe_ttfts,
        "bound_per_replica": bounds.get(MODEL, []),
        "placement": placement,
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


def warmup_requests(args: argparse.Namespace, replicas: int) -> int:
    """How many requests to drive directly, unmeasured, before the first phase: by default
    two of the largest direct setting's rounds on real engines, none on the simulator."""
    if args.warmup_requests is not None:
        return min(args.warmup_requests, args.requests)
    if args.engine == "sim":
        return 0
    return min(2 * max(args.direct_concurrency) * replicas, args.requests)


async def bench(args: argparse.Namespace, stack: Stack, round_index: int = 0) -> dict[str, Any]:
    phases = iter(range(1, 1000))  # each phase its own documents (requests_of)
    placement = stack.placement()
    # The engines the batch runs on: the batch pool's when there is one.
    replicas = stack.replicas("batch" if stack.split else "")
    directs: list[dict[str, Any]] = []
    # Every other round the other way round, so a machine getting busier or quieter over a
    # round does not always favour the same setting.
    order = args.direct_concurrency[:: -1 if (round_index + args.first_round) % 2 else 1]

    async def drive(concurrency: int, after_batch: bool) -> None:
        async with Phase(stack, replicas) as phase:
            run = await direct(replicas, requests_of(args, next(phases)), concurrency)
        run.update(phase.result)
        run["concurrency_per_replica"] = concurrency
        run["after_batch"] = after_batch
        directs.append(run)
        print(
            f"direct at {concurrency}/replica: {run['tokens_per_s']:,.0f} tokens/s", file=sys.stderr
        )

    warmup = warmup_requests(args, len(replicas))
    if warmup:
        # Fresh engines: the family prefixes cached (and any first-request costs paid) before
        # the first measured phase, as every later phase finds them. The interactive engines
        # too, through the gateway.
        top = max(args.direct_concurrency)
        await direct(replicas, requests_of(args, 0)[:warmup], top)
        await probes(stack.url, 10 * args.probe_rate, asyncio.Event(), 10)
        print(f"warm-up: {warmup} requests at {top}/replica, 10 probes", file=sys.stderr)
    for concurrency in order:
        await drive(concurrency, after_batch=False)
    direct_run = max(directs, key=lambda r: r["tokens_per_s"])
    async with Phase(stack, replicas) as idle_phase:
        idle = await probes(stack.url, args.probe_rate, asyncio.Event(), args.idle_probes)
    print(f"idle probes: p90 {summary(idle)['p90_ms']:.1f} ms", file=sys.stderr)
    batches = []
    for i, (runner, concurrency) in enumerate(batch_settings(args.runner, args.batch_concurrency)):
        if i:
            stack.restart_gateway(concurrency, runner)
        async with Phase(stack, replicas) as phase:
            batch = await run_batch(stack, requests_of(args, next(phases)), args.probe_rate)
        batch.update(phase.result)
        batch["concurrency_per_replica"] = concurrency
        batch["ttft_ms"] = [round(1000 * t, 2) for t in batch["ttft"]]  # in sending order
        batch["ttft"] = summary(batch["ttft"])
        print(
            f"batch at {concurrency}/replica, {runner} runner: "
            f"{batch['tokens_per_s']:,.0f} tokens/s, "
            f"TTFT p90 {batch['ttft']['p90_ms']:.1f} ms",
            file=sys.stderr,
        )
        batches.append(batch)
    if args.direct_after:
        # The same settings again in reverse (A B, batch, B A): each setting's mean then
        # brackets the batch, so a load that drifts over the round cancels out.
        for concurrency in order[::-1]:
            await drive(concurrency, after_batch=True)
    return {
        "warmup_requests": warmup,
        "placement": placement,
        "direct": direct_run,
        "directs": directs,
        "idle_ttft": summary(idle),
        "idle_ttft_ms": [round(1000 * t, 2) for t in idle],
        "idle_phase": idle_phase.result,
        "batches": batches,
    }


def batch_settings(runners: list[str], concurrencies: list[str]) -> list[tuple[str, str]]:
    """The batch phases of a round, in order: each runner with each batch concurrency."""
    return [(runner, c) for runner in runners for c in concurrencies]


def round_directs(round_: dict[str, Any]) -> dict[int, float]:
    """One round's direct tokens/s per setting: the mean of its runs (before and, with
    --direct-after, after the batch)."""
    runs: dict[int, list[float]] = {}
    for run in round_["directs"]:
        runs.setdefault(run["concurrency_per_replica"], []).append(run["tokens_per_s"])
    return {c: statistics.fmean(tps) for c, tps in runs.items()}


def summarize_rounds(rounds: list[dict[str, Any]], batch_settings: list[str]) -> dict[str, Any]:
    """Medians over rounds. The engines' maximum is the best direct setting by its median over
    the rounds (each setting measured in every round, in alternating order), not the median
    of each round's best, which favours whichever setting the noise favoured in a round.
    Beside it, each round's batch against that round's own best direct, and their median."""
    med = statistics.median
    per_round = [round_directs(r) for r in rounds]
    settings = sorted({c for directs in per_round for c in directs})
    by_setting = {c: med([d[c] for d in per_round if c in d]) for c in settings}
    best = max(settings, key=lambda c: by_setting[c])
    maximum = by_setting[best]
    idle_p90 = med([r["idle_ttft"]["p90_ms"] for r in rounds])

    def engine_ttft(phases: list[dict[str, Any]]) -> float | None:
        values = [p.get("interactive_engine_ttft_mean_ms") for p in phases]
        return med(values) if None not in values else None

    batches = []
    for i, concurrency in enumerate(batch_settings):
        runs = [r["batches"][i] for r in rounds]
        tps = med([b["tokens_per_s"] for b in runs])
        p90 = med([b["ttft"]["p90_ms"] for b in runs])
        pairs = list(zip(runs, rounds, strict=True))
        batches.append({
            "concurrency_per_replica": concurrency,
            # (results from before the runner process ran the batch in the gateway)
            "runner": runs[0].get("runner", "gateway"),
            "batch_tokens_per_s": tps,
            "share_of_direct": tps / maximum,
            "share_of_round_best_each": [
                b["tokens_per_s"] / max(round_directs(r).values()) for b, r in pairs
            ],
            "ttft_p50_ms": med([b["ttft"]["p50_ms"] for b in runs]),
            "ttft_p90_ms": p90,
            "ttft_p90_vs_idle": p90 / idle_p90 - 1,
            "ttft_p90_vs_idle_each": [
                b["ttft"]["p90_ms"] / r["idle_ttft"]["p90_ms"] - 1 for b, r in pairs
            ],
            "interactive_engine_ttft_mean_ms": engine_ttft(runs),
            "gateway_cpu_s": med([b["gateway_cpu_s"] for b in runs]),
            "runner_cpu_s": med([b.get("runner_cpu_s", 0.0) for b in runs]),
            "engine_cpu_util": med([b["engine_cpu_util"] for b in runs]),
            "interactive_engine_cpu_util": med([b["interactive_engine_cpu_util"] for b in runs]),
            # the bound per replica the batch ran at: median and last (adaptive: adapted)
            "bound_median": med([med(b["bound_per_replica"] or [0]) for b in runs]),
            "bound_last": med([(b["bound_per_replica"] or [0])[-1] for b in runs]),
            "completed": [b["request_counts"]["completed"] for b in runs],
        })  # fmt: skip
        row = batches[-1]
        row["share_of_round_best"] = med(row["share_of_round_best_each"])
        row["ttft_p90_vs_idle_median_of_rounds"] = med(row["ttft_p90_vs_idle_each"])
    return {
        "rounds": len(rounds),
        "direct_by_setting": by_setting,
        "direct_best_setting": best,
        "direct_tokens_per_s": maximum,
        "direct_round_best_median": med([max(d.values()) for d in per_round]),
        "direct_engine_cpu_util": med(
            [
                run["engine_cpu_util"]
                for r in rounds
                for run in r["directs"]
                if run["concurrency_per_replica"] == best
            ]
        ),
        "idle_ttft_p50_ms": med([r["idle_ttft"]["p50_ms"] for r in rounds]),
        "idle_ttft_p90_ms": idle_p90,
        "idle_interactive_engine_ttft_mean_ms": engine_ttft(
            [r.get("idle_phase", {}) for r in rounds]
        ),
        "batches": batches,
    }


# What must agree between results files before their rounds are combined.
SAME_WORKLOAD = ("engine", "replicas", "interactive_replicas", "requests", "families",
                 "prefix_words", "doc_words", "max_tokens", "time_scale", "sim_gpu", "sim_model",
                 "max_num_seqs", "batch_concurrency", "scheduling_policy", "probe_rate",
                 "batch_cpus", "interactive_cpus", "control_cpus", "runner",
                 "runner_cpus")  # fmt: skip


def combine(paths: list[Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The rounds of several results files of the same workload (separate invocations, to
    keep each under the heavy-run lock's ~15 minutes), and the first file's args. ValueError
    naming the file and the setting that differs."""
    first: dict[str, Any] | None = None
    rounds: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(path.read_text())
        args = data["args"]
        if first is None:
            first = args
        for key in SAME_WORKLOAD:
            # (a key older files lack is the same as its empty default)
            if (args.get(key) or None) != (first.get(key) or None):
                raise ValueError(
                    f"{path}: {key} is {args.get(key)!r}, not {first.get(key)!r} as in {paths[0]}"
                )
        rounds += data["rounds"]
    if first is None:
        raise ValueError("--combine: no results files given")
    return first, rounds


def print_tables(rounds: list[dict[str, Any]], median: dict[str, Any]) -> None:
    print("| direct concurrency per replica | tokens/s per round | median "
          "| batch engines' CPU (cores) |\n|---|---|---|---|")  # fmt: skip
    for c, tps in median["direct_by_setting"].items():
        runs = [run for r in rounds for run in r["directs"] if run["concurrency_per_replica"] == c]
        each = ", ".join(
            f"{run['tokens_per_s']:,.0f}" + (" (after)" if run.get("after_batch") else "")
            for run in runs
        )
        cpu = statistics.median(run["engine_cpu_util"] for run in runs)
        print(f"| {c} | {each} | {tps:,.0f} | {cpu:.2f} |")
    engine_idle = median["idle_interactive_engine_ttft_mean_ms"]
    print(
        f"\ndirect (the engines' maximum, at {median['direct_best_setting']}/replica, median of "
        f"{median['rounds']} rounds): {median['direct_tokens_per_s']:,.0f} tokens/s; "
        f"interactive TTFT idle: p50 {median['idle_ttft_p50_ms']:.1f} ms, "
        f"p90 {median['idle_ttft_p90_ms']:.1f} ms"
        + (f", the interactive engine's own {engine_idle:.1f} ms (mean)" if engine_idle else "")
        + "\n"
    )
    print("| batch concurrency per replica, runner | bound (median, last) | batch tokens/s "
          "| of direct (per round) | TTFT p50 | TTFT p90 | p90 vs idle (per round) "
          "| interactive engine's TTFT | gateway CPU | runner process CPU "
          "| engines' CPU (batch, interactive) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in median["batches"]:
        shares = ", ".join(f"{x:.1%}" for x in row["share_of_round_best_each"])
        p90s = ", ".join(f"{x:+.0%}" for x in row["ttft_p90_vs_idle_each"])
        engine = row["interactive_engine_ttft_mean_ms"]
        print(
            f"| {row['concurrency_per_replica']}, {row['runner']} "
            f"| {row['bound_median']:.0f}, {row['bound_last']:.0f} "
            f"| {row['batch_tokens_per_s']:,.0f} "
            f"| {row['share_of_direct']:.1%} ({shares}) | {row['ttft_p50_ms']:.1f} ms "
            f"| {row['ttft_p90_ms']:.1f} ms | {row['ttft_p90_vs_idle']:+.0%} ({p90s}) "
            f"| {f'{engine:.1f} ms' if engine else '-'} "
            f"| {row['gateway_cpu_s']:.1f} s | {row['runner_cpu_s']:.1f} s "
            f"| {row['engine_cpu_util']:.2f}, {row['interactive_engine_cpu_util']:.2f} |"
        )


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
        "--warmup-requests",
        type=int,
        default=None,
        help="requests driven directly, unmeasured, before the first phase of each round "
        "(and 10 interactive probes); default: 2 x the largest direct setting x replicas on "
        "vllm-cpu, 0 on sim",
    )
    parser.add_argument(
        "--direct-after",
        action="store_true",
        help="drive the engines directly again after the batch (settings in reverse order); "
        "each setting's tokens/s is then the mean of its runs before and after the batch",
    )
    parser.add_argument(
        "--batch-concurrency",
        type=lambda text: text.split(","),
        default=["adaptive"],
        help="'adaptive' (the default config: the bound adapts to the engines' queues) or a "
        "fixed batch.concurrency_per_replica; a comma list runs one batch per value",
    )
    parser.add_argument(
        "--runner",
        type=lambda text: text.split(","),
        default=["process"],
        help="who runs the batch: 'process' (`hpcserve batch-runner`, batch.runner = "
        "'process') or 'gateway' (the gateway the probes use); 'gateway,process' runs a batch "
        "phase with each, side by side",
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
    parser.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="this invocation's first round's number (odd: direct settings in reverse order), "
        "when rounds run as separate invocations to be --combine'd",
    )
    for role, where in (
        ("batch", "the batch pool's engine process trees (or the shared pool's)"),
        ("interactive", "the interactive pool's engine process trees"),
        ("control", "this benchmark's client, the router and the gateway"),
        ("runner", "the batch runner process (default: --batch-cpus)"),
    ):
        parser.add_argument(
            f"--{role}-cpus",
            default="",
            help=f"CPU list ('0', '2-3') {where} may run on (sched_setaffinity; vLLM CPU's OMP "
            "threads bound to them: VLLM_CPU_OMP_THREADS_BIND); default: anywhere",
        )
    parser.add_argument(
        "--combine",
        type=lambda text: [Path(x) for x in text.split(",")],
        default=[],
        help="run nothing: combine these results files' rounds (same workload) into one "
        "results file (--tag) with medians over all of them",
    )
    parser.add_argument("--tag", default="", help="results file suffix: ...-<engine>-<tag>.json")
    args = parser.parse_args()
    # Stopped (SIGTERM, or SIGINT where a background shell ignores it): stop the stack too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.combine:
        try:
            run_args, rounds = combine(args.combine)
        except (OSError, ValueError, KeyError) as err:
            parser.error(str(err))
        run_args = {**run_args, "combine": [str(p) for p in args.combine], "tag": args.tag}
        engine = run_args["engine"]
    else:
        wrong = [r for r in args.runner if r not in ("gateway", "process")]
        if wrong:
            parser.error(f"--runner: {wrong[0]!r} is not 'gateway' or 'process'")
        if not args.runner_cpus:
            args.runner_cpus = args.batch_cpus
        for role in ("batch", "interactive", "control", "runner"):
            try:
                cpus = parse_cpus(getattr(args, f"{role}_cpus"), f"--{role}-cpus")
            except ValueError as err:
                parser.error(str(err))
            setattr(args, f"{role}_cpus", cpus)
        if args.control_cpus:
            # Before anything starts: the router and gateway inherit it.
            os.sched_setaffinity(0, args.control_cpus)
        rounds = []
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
                stack = Stack(args, Path(tmp))
                try:
                    stack.start()
                    rounds.append(asyncio.run(bench(args, stack, i)))
                finally:
                    stack.stop()
        run_args = {
            **vars(args),
            **{
                f"{r}_cpus": cpu_list(getattr(args, f"{r}_cpus"))
                for r in ("batch", "interactive", "control", "runner")
            },
        }
        engine = args.engine
    settings = batch_settings(run_args.get("runner") or ["gateway"], run_args["batch_concurrency"])
    median = summarize_rounds(rounds, [c for _, c in settings])
    best = median["direct_best_setting"]
    rows = [
        {"run": f"direct, {best}/replica (the maximum)",
         "tokens_per_s": round(median["direct_tokens_per_s"]), "of_direct": 1.0,
         "ttft_p50_ms": round(median["idle_ttft_p50_ms"], 1),
         "ttft_p90_ms": round(median["idle_ttft_p90_ms"], 1), "ttft_p90_vs_idle": 0.0},
        *(
            {"run": f"batch, {row['concurrency_per_replica']}/replica, {row['runner']} runner",
             "tokens_per_s": round(row["batch_tokens_per_s"]),
             "of_direct": round(row["share_of_direct"], 3),
             "ttft_p50_ms": round(row["ttft_p50_ms"], 1),
             "ttft_p90_ms": round(row["ttft_p90_ms"], 1),
             "ttft_p90_vs_idle": round(row["ttft_p90_vs_idle"], 2)}
            for row in median["batches"]
        ),
    ]  # fmt: skip
    print_tables(rounds, median)
    result = {"rows": rows, "args": run_args, "rounds": rounds, "median": median}
    tag = f"-{args.tag}" if args.tag else ""
    out = write_results(f"batch_throughput-{engine}{tag}", result)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
