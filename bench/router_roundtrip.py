"""What a routing decision adds to a request, seen from a gateway process.

The router runs in its own process (as deployed), with REPLICAS replicas registered (no KV
events: approximate mode remembers routed prefixes). A DEALER in this process plays the
gateway, one request at a time, interleaved by case, ROUNDS rounds of N requests:

- route: Route(model) -> RouteReply, then Release (two sends; what the gateway does today);
- route+hashes: the same with the prefix fields of a 2,048-token prompt (128 block hashes);
- folded: Route with the previous request's Release folded in (`Route.released`): one send;

p50/p99 round trip, and the gateway-side CPU per request (process time of this process).
Then the gateway's own client, as the gateway runs it: gateway/routing_client.py on uvloop,
`route()` then `release()` per request, at concurrency 1 and 64 (the Routes of one loop
iteration leave as one message), with this process pinned to core 0 and the router to
core 1; p50/p99 of `route()`, CPU per request of both sides (from /proc), requests/s.
Also the gateway-side cost of the prefix fields themselves: RouteHints.hints (chat
template + tokenizer + chained hashes) for a ~2,000-token chat prompt on the tiny chat model.

    .venv/bin/python bench/router_roundtrip.py [--rounds 3] [--requests 3000]

Writes bench/results/router_roundtrip.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from hpcserve.config import RouterConfig  # noqa: E402
from hpcserve.engine_launch.agent import RegistryAgent  # noqa: E402
from hpcserve.router import protocol as p  # noqa: E402
from hpcserve.router.prefix_hash import prompt_block_hashes  # noqa: E402
from tests.ports import free_port  # noqa: E402

REPLICAS = 8


def serve(config: RouterConfig) -> None:
    from hpcserve.router.server import RouterServer

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})

    RouterServer(config).serve_forever()


def measure(sock: zmq.Socket, make, n: int, release: bool) -> tuple[list[float], float]:
    lat = []
    cpu0 = time.process_time()
    previous = ""
    for i in range(n):
        msg = make(i, previous)
        t0 = time.perf_counter()
        sock.send(p.encode(msg))
        reply = p.routing_reply_decoder.decode(sock.recv())
        lat.append(time.perf_counter() - t0)
        if release:
            sock.send(p.encode(p.Release(reply.replica_id)))
        else:
            previous = reply.replica_id
    return lat, (time.process_time() - cpu0) / n


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ZmqAsyncioClient:
    """The previous gateway client, for comparison in the same run: a zmq.asyncio DEALER, a
    reader task matching replies to futures, one message per Route and per Release."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def start(self) -> None:
        import asyncio
        import itertools

        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            reply = p.routing_reply_decoder.decode(await self._sock.recv())
            future = self._pending.pop(reply.request_id, None)
            if future is not None and not future.done():
                future.set_result(reply)

    async def route(self, model: str) -> p.RouteReply:
        import asyncio

        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        async with asyncio.timeout(5.0):
            await self._sock.send(p.encode(p.Route(request_id, model)))
            return await future

    def release(self, replica_id: str) -> None:
        self._sock.send(p.encode(p.Release(replica_id)), zmq.NOBLOCK)

    async def close(self) -> None:
        import asyncio

        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(0)
        self._ctx.term()


async def client_case(
    endpoint: str, router_pid: int, n: int, concurrency: int, baseline: bool = False
) -> dict:
    """The gateway's RoutingClient: route() + release() per request, `concurrency` at once."""
    import asyncio

    from hpcserve.gateway.routing_client import RoutingClient

    client: Any = ZmqAsyncioClient(endpoint) if baseline else RoutingClient(endpoint, timeout_s=5.0)
    await client.start()
    lat: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            t0 = time.perf_counter()
            reply = await client.route("m")
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0)  # the relay would run here
            client.release(reply.replica_id)

    await asyncio.gather(*(worker(100) for _ in range(concurrency)))  # warm up
    lat.clear()
    per_worker = max(n // concurrency, 1)
    cpu0, router0, wall0 = time.process_time(), cpu_seconds(router_pid), time.perf_counter()
    await asyncio.gather(*(worker(per_worker) for _ in range(concurrency)))
    total = per_worker * concurrency
    wall = time.perf_counter() - wall0
    result = {
        "cpu": (time.process_time() - cpu0) / total * 1e6,
        "router_cpu": (cpu_seconds(router_pid) - router0) / total * 1e6,
        "rps": total / wall,
    }
    await client.close()
    lat.sort()
    result["p50"] = lat[len(lat) // 2] * 1e6
    result["p99"] = lat[int(len(lat) * 0.99)] * 1e6
    return result


def hints_cost() -> float:
    from hpcserve.router.prompt_tokens import PromptTokenizer, RouteHints
    from hpcserve.tinymodels import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_model("chat", Path(d) / "chat")
        hints = RouteHints()
        hints.add_model("m", PromptTokenizer.from_dir(model), 16)
        rng = random.Random(0)
        words = ["router", "cache", "block", "prefix", "replica", "token", "gateway", "slurm"]
        text = " ".join(rng.choice(words) for _ in range(900))
        payload = {
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
        }
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            got = hints.hints("m", payload, {})
            times.append(time.perf_counter() - t0)
        print(f"(hints for a {got['prompt_tokens']}-token prompt)")
        return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    config = RouterConfig(
        registry_bind=f"tcp://127.0.0.1:{free_port()}",
        routing_bind=f"tcp://127.0.0.1:{free_port()}",
        lease_s=1e6,
        metrics_port=0,
    )
    proc = multiprocessing.get_context("fork").Process(target=serve, args=(config,), daemon=True)
    proc.start()
    agents = [
        RegistryAgent(config.registry_bind, p.Register(f"r{i}", "m", f"http://r{i}", block_size=16))
        for i in range(REPLICAS)
    ]
    for agent in agents:
        agent.register()
        agent.process_replies(5.0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.routing_bind)
    rng = random.Random(1)
    prompts = [
        prompt_block_hashes([rng.randrange(50_000) for _ in range(2048)], 16) for _ in range(50)
    ]
    cases = {
        "route + release": (lambda i, prev: p.Route(i, "m"), True),
        "route + release, 128 hashes": (
            lambda i, prev: p.Route(
                i, "m", block_hashes=prompts[i % 50], block_size=16, prompt_tokens=2048
            ),
            True,
        ),
        "route with release folded in": (
            lambda i, prev: p.Route(i, "m", released=[prev] if prev else []),
            False,
        ),
    }
    results: dict[str, dict[str, list[float]]] = {
        c: {"p50": [], "p99": [], "cpu": []} for c in cases
    }
    measure(sock, cases["route + release"][0], 500, True)  # warm up
    for _ in range(args.rounds):
        for name, (make, release) in cases.items():
            lat, cpu = measure(sock, make, args.requests, release)
            lat.sort()
            results[name]["p50"].append(lat[len(lat) // 2] * 1e6)
            results[name]["p99"].append(lat[int(len(lat) * 0.99)] * 1e6)
            results[name]["cpu"].append(cpu * 1e6)
    sock.close(0)
    import uvloop

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})
    client_cases = {
        (1, True): "before: zmq.asyncio DEALER, c=1",
        (1, False): "RoutingClient (uvloop), c=1",
        (64, True): "before: zmq.asyncio DEALER, c=64",
        (64, False): "RoutingClient (uvloop), c=64",
    }
    client_results: dict[str, dict[str, list[float]]] = {
        name: {"p50": [], "p99": [], "cpu": [], "router_cpu": [], "rps": []}
        for name in client_cases.values()
    }
    for _ in range(args.rounds):
        for (concurrency, baseline), name in client_cases.items():
            got = uvloop.run(
                client_case(config.routing_bind, proc.pid, args.requests, concurrency, baseline)
            )
            for key, value in got.items():
                client_results[name][key].append(value)
    for agent in agents:
        agent.close()
    proc.terminate()
    proc.join(5)
    hints_s = hints_cost()
    summary = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    client_summary = {
        name: {k: statistics.median(v) for k, v in r.items()} for name, r in client_results.items()
    }
    out = {
        "cases_us": summary,
        "gateway_client_us": client_summary,
        "load_average": os.getloadavg(),
        "gateway_hints_2k_prompt_p50_us": hints_s * 1e6,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "command": " ".join(["bench/router_roundtrip.py", *sys.argv[1:]]),
    }
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "router_roundtrip.json").write_text(json.dumps(out, indent=2))
    print("| case | round trip p50 | p99 | gateway CPU per request |")
    print("|---|---|---|---|")
    for name, r in summary.items():
        print(f"| {name} | {r['p50']:.0f} us | {r['p99']:.0f} us | {r['cpu']:.0f} us |")
    print(
        f"| RouteHints.hints, ~2k-token chat prompt (gateway side) | | | {hints_s * 1e6:.0f} us |"
    )
    print()
    print("| gateway client | route() p50 | p99 | gateway CPU / request | router CPU / request "
          "| requests/s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, r in client_summary.items():
        print(f"| {name} | {r['p50']:.0f} us | {r['p99']:.0f} us | {r['cpu']:.0f} us "
              f"| {r['router_cpu']:.0f} us | {r['rps']:.0f} |")  # fmt: skip
    print(f"\nload average {os.getloadavg()}")


if __name__ == "__main__":
    main()
