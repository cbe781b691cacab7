"""Soak: sustained mixed load through the real gateway process; its memory must stay flat.

A real router, a real simulated engine (`hpcserve engine --engine sim` entry, 1 ms per
token) and the real gateway process (`hpcserve gateway`, a tenant with limits so the quota
path runs), all on loopback. CONCURRENCY clients send, for SECONDS, a mix of streamed and
whole chat completions and completions (one in four streamed with include_usage, one in
four streamed without), plus one bad request in twenty. The gateway's RSS is sampled every
second; after WARMUP seconds it must not grow by more than 5%.

    .venv/bin/python bench/gateway_soak.py [--seconds 60] [--concurrency 16] [--warmup 15]

Prints a summary and writes bench/results/gateway_soak.json. Exit status 1 if RSS grew or
any answer was a 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.http_wait import wait_http  # noqa: E402
from bench.results import write_results  # noqa: E402
from hpcserve.config import dump_config, hash_api_key, parse_config  # noqa: E402
from hpcserve.contracts import protocol as p  # noqa: E402
from hpcserve.engine_launch.agent import RegistryAgent  # noqa: E402
from tests.ports import free_port  # noqa: E402

KEY = "sk-soak"
MODEL = "soak"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def request_for(i: int) -> tuple[str, dict[str, object] | bytes]:
    if i % 20 == 19:
        return "/v1/chat/completions", b'{"model": "soak", "max_tokens": -1}'
    chat = i % 2 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, object] = {"model": MODEL, "max_tokens": 16}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i} " * 20}]
    else:
        body["prompt"] = f"request {i} " * 20
    if i % 4 == 1:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    elif i % 4 == 3:
        body["stream"] = True
    return path, body


async def drive(base: str, seconds: float, concurrency: int) -> dict[str, int]:
    statuses: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9))
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            path, body = request_for(next(counter))
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with session.post(base + path, data=data, headers=headers) as response:
                payload = await response.read()
                key = str(response.status)
                if response.status == 200 and payload.startswith(b"data: "):
                    key += " stream" + (" [DONE]" if payload.endswith(b"[DONE]\n\n") else " CUT")
                statuses[key] = statuses.get(key, 0) + 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return statuses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=15)
    args = parser.parse_args()
    # A SIGTERM (e.g. from `timeout`) still stops the processes this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    work = Path(tempfile.mkdtemp(prefix="hpcserve-soak-"))
    py = sys.executable
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        procs.append(proc)
        return proc

    router = {
        "registry_bind": f"tcp://127.0.0.1:{free_port()}",
        "routing_bind": f"tcp://127.0.0.1:{free_port()}",
        "metrics_port": 0,
        "allow_plain_loopback": True,  # its agent registers without keys
    }
    gateway_port, engine_port = free_port(), free_port()
    config = parse_config(
        {
            "router": router,
            "gateway": {
                "port": gateway_port,
                "api_keys": [{"tenant": "soak", "sha256": hash_api_key(KEY)}],
                "tenants": [{"name": "soak", "requests_per_min": 10**8, "tokens_per_min": 10**10}],
            },
            "pools": [{"name": MODEL, "model_path": "/nonexistent", "engine": "sim"}],
        }
    )
    path = work / "soak.toml"
    path.write_text(dump_config(config))
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    try:
        spawn([py, "-m", "hpcserve.cli", "router", "--config", str(path)])
        spawn([py, "-m", "hpcserve.sim.launch", "--port", str(engine_port),
               "--served-model-name", MODEL, "--decode-ms-per-token", "1"])  # fmt: skip
        gateway = spawn([py, "-m", "hpcserve.cli", "gateway", "--config", str(path)])
        base = f"http://127.0.0.1:{gateway_port}"
        wait_http(base + "/health")
        wait_http(f"http://127.0.0.1:{engine_port}/health")
        engine_url = f"http://127.0.0.1:{engine_port}"
        agent = RegistryAgent(router["registry_bind"], p.Register("soak-1", MODEL, engine_url))

        def heartbeat() -> None:
            agent.register()
            while not stop.is_set():
                agent.heartbeat(p.ReplicaLoad())
                agent.process_replies(1.0)  # returns at the ack: not a sleep
                stop.wait(1.0)

        def sample() -> None:
            started = time.monotonic()
            while not stop.wait(1.0):
                samples.append((time.monotonic() - started, rss_mib(gateway.pid)))

        threads = [threading.Thread(target=f, daemon=True) for f in (heartbeat, sample)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        started = time.monotonic()
        statuses = asyncio.run(drive(base, args.seconds, args.concurrency))
        elapsed = time.monotonic() - started
        stop.set()
        for thread in threads:
            thread.join(3)
        agent.close()
    finally:
        stop.set()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)

    after_warmup = [rss for t, rss in samples if t >= args.warmup]
    first = statistics.median(after_warmup[:5])
    last = statistics.median(after_warmup[-5:])
    growth = (last - first) / first
    total = sum(statuses.values())
    server_errors = sum(n for s, n in statuses.items() if s.startswith("5"))
    cut = sum(n for s, n in statuses.items() if s.endswith("CUT"))
    summary = {
        "requests": total,
        "req_per_s": round(total / elapsed, 1),
        "statuses": statuses,
        "rss_mib_after_warmup": round(first, 1),
        "rss_mib_at_end": round(last, 1),
        "rss_growth_pct": round(growth * 100, 2),
        "rss_samples": [[round(t, 1), round(r, 1)] for t, r in samples],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rss_samples"}, indent=2))
    write_results("gateway_soak", summary)
    if growth > 0.05 or server_errors or cut:
        sys.exit(1)


if __name__ == "__main__":
    main()
