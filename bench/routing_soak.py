"""Soak the routing socket: does any Route go unanswered, or any in-flight count go wrong?

A real router (in this process, its own thread, as in the tests) with one registered replica,
and the gateway's routing client driving Routes at a fixed concurrency, each with a prompt of
20-300 block hashes (frames of 0.2-3 kB), each released a moment after its answer. Optionally
through a loopback proxy (tests/tcp_proxy.py) that delivers the bytes in random small pieces
(`--pieces`) and cuts every connection now and then (`--cut-every-s`).

It looks for what was seen once at concurrency 64 (a Route with no answer within 5 s) and
prints, per case: Routes, those answered by the fallback view (the router did not answer in
time), the slowest answer, answers slower than 1 s, and whether the router's in-flight count
came back to zero. Not a performance benchmark: the figures say nothing was lost.

    .venv/bin/python bench/routing_soak.py --routes 100000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import load_average, write_results  # noqa: E402
from hpcserve.gateway.routing_client import RoutingClient  # noqa: E402
from hpcserve.router.server import RouterServer  # noqa: E402
from tests.routers import router_with_one_replica  # noqa: E402
from tests.tcp_proxy import TcpProxy  # noqa: E402


async def soak(
    router: RouterServer, endpoint: str, args: argparse.Namespace, proxy: TcpProxy | None
) -> dict[str, object]:
    client = RoutingClient(endpoint, timeout_s=args.route_timeout_s, view_refresh_s=0.5)
    await client.start()
    rng = random.Random(args.seed)
    left = args.routes
    latencies: list[float] = []
    fallback = 0

    async def worker() -> None:
        nonlocal left, fallback
        loop = asyncio.get_running_loop()
        while left > 0:
            left -= 1
            blocks = [rng.getrandbits(62) for _ in range(rng.randint(20, 300))]
            started = loop.time()
            reply = await client.route(
                "docs", block_hashes=blocks, block_size=16, prompt_tokens=16 * len(blocks)
            )
            latencies.append(loop.time() - started)
            fallback += not reply.epoch
            await asyncio.sleep(rng.random() * 0.005)
            client.release("a", "docs")

    async def cutter() -> None:
        while proxy is not None and args.cut_every_s > 0:
            await asyncio.sleep(args.cut_every_s)
            proxy.cut()

    started = time.monotonic()
    cuts = asyncio.ensure_future(cutter())
    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        cuts.cancel()
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        replica = router.registry.get("a")
        if replica is not None and not replica.in_flight and not router.in_flight_book.total():
            break
        await asyncio.sleep(0.05)
    replica = router.registry.get("a")
    await client.close()
    latencies.sort()
    return {
        "routes": len(latencies),
        "seconds": round(elapsed, 1),
        "fallback": fallback,
        "p50_ms": round(latencies[len(latencies) // 2] * 1e3, 2),
        "max_ms": round(latencies[-1] * 1e3, 1),
        "over_1s": sum(1 for x in latencies if x > 1.0),
        "in_flight_after": replica.in_flight if replica else -1,
        "connections": proxy.connections if proxy else 1,
    }


async def run_case(args: argparse.Namespace, pieces: int, cut_every_s: float) -> dict[str, object]:
    with router_with_one_replica(lease_s=3600.0) as (config, router):
        endpoint, proxy = config.routing_bind, None
        if pieces or cut_every_s:
            proxy = TcpProxy(int(config.routing_bind.rsplit(":", 1)[1]), pieces=pieces)
            await proxy.start()
            endpoint = proxy.endpoint
        case = argparse.Namespace(**{**vars(args), "cut_every_s": cut_every_s})
        try:
            row = await soak(router, endpoint, case, proxy)
        finally:
            if proxy is not None:
                await proxy.close()
    return {"pieces": pieces, "cut_every_s": cut_every_s, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routes", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--route-timeout-s", type=float, default=5.0)
    parser.add_argument("--pieces", type=int, default=251, help="for the proxied cases")
    parser.add_argument("--cut-every-s", type=float, default=2.0, help="for the cut case")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    load_before = load_average()
    cases = [(0, 0.0), (args.pieces, 0.0), (0, args.cut_every_s)]
    rows = [asyncio.run(run_case(args, pieces, cut)) for pieces, cut in cases]
    columns = list(rows[0])
    print(f"routing soak, concurrency {args.concurrency}, load before {load_before}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    write_results(
        "routing_soak",
        {"rows": rows},
        {"concurrency": args.concurrency, "routes": args.routes, "load_before": load_before},
    )


if __name__ == "__main__":
    main()
