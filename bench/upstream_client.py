"""The relay's HTTP client against aiohttp's, side by side in one run, in one process.

Both clients send the same ~1.3 KB chat request to a fixed-response nginx (the upstream of
bench/proxy_overhead.py: a completion, or the 16-event SSE body for a streamed request) over
pooled keep-alive connections, sequentially (c=1) or from N tasks at once, and read the whole
answer (chat) or its chunks as they come (stream). This process is pinned to core 0, nginx to
core 1. Per client and case, medians of ROUNDS interleaved rounds: the client's CPU time per
request (process time over requests: the figure that matters for a proxy on one core),
requests/s, and at c=1 the p50 and p99 round trip.

    .venv/bin/python bench/upstream_client.py [--rounds 5] [--requests 5000] [--concurrency 64]

Needs nginx (Debian `nginx-light`). Prints a markdown table and writes
bench/results/upstream_client.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import uvloop  # noqa: E402

from bench.http_wait import wait_http  # noqa: E402
from bench.proxy_overhead import CHAT_BODY, STREAM_MARK, nginx_config  # noqa: E402
from bench.results import load_average, write_results  # noqa: E402
from hpcserve.gateway.upstream_http import UpstreamClient  # noqa: E402
from tests.ports import free_port  # noqa: E402

CLIENTS = ("upstream_http", "aiohttp")


async def _ours(url: str, headers: dict[str, str], stream: bool):  # type: ignore[no-untyped-def]
    client = UpstreamClient(first_byte_timeout_s=30, idle_timeout_s=30)

    async def one() -> int:
        response = await client.request("POST", url, CHAT_BODY, headers)
        if not stream:
            return len(await response.read())
        size = 0
        while chunk := await response.next_chunk():
            size += len(chunk)
        return size

    return one, client.close


async def _aiohttp(url: str, headers: dict[str, str], stream: bool):  # type: ignore[no-untyped-def]
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
    )

    async def one() -> int:
        async with session.post(url, data=CHAT_BODY, headers=headers) as response:
            if not stream:
                return len(await response.read())
            size = 0
            async for chunk in response.content.iter_any():
                size += len(chunk)
            return size

    return one, session.close


async def measure(
    name: str, url: str, stream: bool, requests: int, concurrency: int
) -> dict[str, float]:
    headers = {"Content-Type": "application/json"}
    if stream:
        headers["X-Request-Id"] = STREAM_MARK
    one, close = await (_ours if name == "upstream_http" else _aiohttp)(url, headers, stream)
    latencies: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            assert await one() > 0
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker(20) for _ in range(concurrency)))  # connections warm
    latencies.clear()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await close()
    done = len(latencies)
    latencies.sort()
    return {
        "cpu_us": cpu / done * 1e6,
        "rps": done / wall,
        "p50_ms": latencies[done // 2] * 1e3,
        "p99_ms": latencies[int(done * 0.99)] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    load_before = load_average()
    work = Path(tempfile.mkdtemp(prefix="upstream-client-"))
    port = free_port()
    conf = nginx_config(work, port)
    nginx = subprocess.Popen(
        ["taskset", "-c", "1", "nginx", "-c", str(conf), "-p", str(work)],
        stderr=subprocess.DEVNULL,
    )
    cases = [
        (kind, concurrency) for kind in ("chat", "stream") for concurrency in (1, args.concurrency)
    ]
    samples: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        wait_http(url)
        os.sched_setaffinity(0, {0})
        for round_ in range(1, args.rounds + 1):
            for kind, concurrency in cases:
                for name in CLIENTS:
                    requests = args.requests // (5 if concurrency == 1 else 1)
                    got = uvloop.run(measure(name, url, kind == "stream", requests, concurrency))
                    samples.setdefault((kind, concurrency, name), []).append(got)
                    print(
                        f"round {round_} {kind} c={concurrency:<3} {name:<13} "
                        f"{got['cpu_us']:7.1f} us CPU/request {got['rps']:8.0f} req/s "
                        f"p50 {got['p50_ms']:.3f} ms",
                        flush=True,
                    )
    finally:
        nginx.terminate()
        nginx.wait()
    rows = []
    for (kind, concurrency, name), runs in samples.items():
        rows.append(
            {
                "case": f"{kind} c={concurrency}",
                "client": name,
                **{
                    key: round(statistics.median(r[key] for r in runs), 3)
                    for key in ("cpu_us", "rps", "p50_ms", "p99_ms")
                },
            }
        )
    load_after = load_average()
    print(
        f"\nload average (1/5/15 min) before {'/'.join(map(str, load_before))}, "
        f"after {'/'.join(map(str, load_after))}; medians of {args.rounds} rounds\n"
    )
    print("| case | client | CPU per request | req/s (one core) | p50 | p99 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['case']} | {row['client']} | {row['cpu_us']:.0f} us | {row['rps']:.0f} | "
            f"{row['p50_ms']:.3f} ms | {row['p99_ms']:.3f} ms |"
        )
    write_results(
        "upstream_client",
        {"rows": rows},
        {"load_average_before": load_before, "rounds": args.rounds, "requests": args.requests},
    )


if __name__ == "__main__":
    main()
