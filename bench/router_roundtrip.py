"""What a routing decision adds to a request, seen from a gateway process, with the router's
routing socket as libzmq's ROUTER, as ZMTP on plain sockets (contracts/zmtp.py), and as ZMTP
with CURVE (contracts/zmtp_curve.py, the default wherever the router has keys), side by side.

Three routers run in their own processes (as deployed), pinned to core 1 (`--router-core`),
one per routing socket, each with REPLICAS replicas registered (no KV events, no heartbeats).
The CURVE router's clients hold the gateway key (the blocking DEALER as libzmq's CURVE
client, the gateway's client as ours); the summary gives CURVE's figures as ratios to the
plain ZMTP router's, measured in the same rounds.
Interleaved by case (the order alternating by round), ROUNDS rounds of N requests, medians:

1. A blocking libzmq DEALER in this process, one request at a time: Route then Release (two
   sends), the same with the prefix fields of a 2,048-token prompt (128 block hashes), and
   Route with the previous Release folded in (one send): p50/p99 round trip, client CPU.
2. The gateway's own client (gateway/routing_client.py on uvloop, this process pinned to core
   0): `route()` then `release()` per request at concurrency 1 and 64: p50/p99 of `route()`,
   CPU per request of this process and of the router (from /proc), requests/s.
3. `--ladder`: the gateway itself (bench/proxy_overhead.py's gateway, its "+ routing" rung,
   pinned to core 0) in front of nginx, driven by wrk on core 1, against each router, beside
   its "+ quotas" rung (the same gateway with a fixed upstream, no router): chat p50 at c=1
   and c=64, req/s, gateway and router CPU per request.

Also the gateway-side cost of the prefix fields themselves: RouteHints.hints (chat template +
tokenizer + chained hashes) for a ~2,000-token chat prompt on the tiny chat model.

    .venv/bin/python bench/router_roundtrip.py [--rounds 3] [--requests 3000] [--ladder]
        [--seconds 4] [--router-core 1]

Writes bench/results/router_roundtrip.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402
import zmq.auth  # noqa: E402

from bench import proxy_overhead as ladder  # noqa: E402
from bench.http_wait import wait_http  # noqa: E402
from bench.results import write_results  # noqa: E402
from hpcserve.config import RouterConfig, dump_config, hash_api_key, parse_config  # noqa: E402
from hpcserve.contracts import protocol as p  # noqa: E402
from hpcserve.contracts.prefix_hash import prompt_block_hashes  # noqa: E402
from hpcserve.engine_launch.agent import RegistryAgent  # noqa: E402
from tests.ports import free_port  # noqa: E402

REPLICAS = 8
MODEL = ladder.MODEL
SOCKETS = ("libzmq", "zmtp", "zmtp-curve")


def serve(config: RouterConfig, routing_socket: str, core: int = 1) -> None:
    from hpcserve.router.server import RouterServer

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {core})

    RouterServer(config, routing_socket=routing_socket.removesuffix("-curve")).serve_forever()


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


async def client_case(
    endpoint: str, router_pid: int, n: int, concurrency: int, curve_dir: str = ""
) -> dict:
    """The gateway's RoutingClient: route() + release() per request, `concurrency` at once."""
    import asyncio

    from hpcserve.contracts.zmtp_curve import routing_client_keys
    from hpcserve.gateway.routing_client import RoutingClient

    client = RoutingClient(endpoint, timeout_s=5.0, curve=routing_client_keys(curve_dir))
    await client.start()
    lat: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            t0 = time.perf_counter()
            reply = await client.route(MODEL)
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
    from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints
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


def ladder_case(
    work: Path,
    routers: dict[str, tuple[RouterConfig, int]],
    upstream: str,
    args: argparse.Namespace,
) -> dict[str, dict[str, float]]:
    """bench/proxy_overhead.py's gateway: its + quotas rung and its + routing rung per router."""
    keys = [{"tenant": "bench", "sha256": hash_api_key(ladder.KEY)}]
    limits = {"requests_per_min": 10**9, "tokens_per_min": 10**12, "max_concurrent": 10**6}
    targets: dict[str, tuple[str, int, int]] = {}  # name -> url, gateway pid, router pid
    procs = []
    try:
        for name, feature, router in [
            ("+ quotas (no router)", "quotas", "zmtp"),
            *((f"+ routing, {s} router", "routing", s) for s in SOCKETS),
        ]:
            config, router_pid = routers[router]
            port = free_port()
            platform_config = parse_config({
                "router": {"registry_bind": config.registry_bind,
                           "routing_bind": config.routing_bind, "metrics_port": 0,
                           "curve_dir": config.curve_dir},
                "gateway": {"port": port, "api_keys": keys,
                            "tenants": [{"name": "bench", **limits}]},
            })  # fmt: skip
            path = work / f"gateway-{feature}-{router}.toml"
            path.write_text(dump_config(platform_config))
            proc = subprocess.Popen(
                ["taskset", "-c", "0", sys.executable, str(ROOT / "bench" / "proxy_overhead.py"),
                 "--serve-gateway", str(path), feature, upstream],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(proc)
            targets[name] = (f"http://127.0.0.1:{port}", proc.pid, router_pid)
        for url, _, _ in targets.values():
            wait_http(url + "/health")
        time.sleep(2.5)  # each routing client has the router's replica list
        body = work / "chat.json"
        body.write_bytes(ladder.CHAT_BODY)
        runs: dict[str, list[dict[str, float]]] = {}
        for round_no in range(args.rounds):
            for conns in (1, 64):
                # Every other round in reverse: no target always runs first (or last).
                order = list(targets.items())[:: 1 if round_no % 2 == 0 else -1]
                for name, (url, pid, router_pid) in order:
                    cpu0, router0 = cpu_seconds(pid), cpu_seconds(router_pid)
                    r = ladder.run_wrk(
                        url + "/v1/chat/completions", body, conns, args.seconds, stream=False
                    )
                    served = r["rps"] * args.seconds
                    r["cpu_us"] = (cpu_seconds(pid) - cpu0) / served * 1e6
                    r["router_cpu_us"] = (
                        (cpu_seconds(router_pid) - router0) / served * 1e6
                        if name.startswith("+ routing")
                        else 0.0
                    )
                    runs.setdefault(f"{name}, c={conns}", []).append(r)
                    print(f"{name}, c={conns}: {r}", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    return {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--ladder", action="store_true", help="also the gateway in front of nginx")
    ap.add_argument("--seconds", type=int, default=4, help="per wrk run (--ladder)")
    ap.add_argument(
        "--router-core",
        type=int,
        default=1,
        help="the routers' core: 1 (beside wrk and nginx, as in proxy_overhead.py) or 0 "
        "(beside the gateway)",
    )
    args = ap.parse_args()
    if args.ladder and not (shutil.which("wrk") and shutil.which("nginx")):
        sys.exit("--ladder needs wrk and nginx (apt-get install wrk nginx-light)")
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="hpcserve-roundtrip-"))
    nginx = None
    upstream = "http://127.0.0.1:9"
    if args.ladder:
        port = free_port()
        conf = ladder.nginx_config(work, port)
        nginx = subprocess.Popen(
            ["taskset", "-c", "1", "nginx", "-p", str(work), "-c", str(conf)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        upstream = f"http://127.0.0.1:{port}"
        wait_http(upstream + "/")
    from hpcserve.contracts.curve import generate_keys

    keys = str(generate_keys(work / "curve"))
    routers: dict[str, tuple[RouterConfig, int]] = {}
    procs, agents = [], []
    for routing_socket in SOCKETS:
        config = RouterConfig(
            registry_bind=f"tcp://127.0.0.1:{free_port()}",
            routing_bind=f"tcp://127.0.0.1:{free_port()}",
            lease_s=1e6,
            metrics_port=0,
            curve_dir=keys if routing_socket.endswith("-curve") else "",
            allow_plain_loopback=not routing_socket.endswith("-curve"),  # the plain baselines
        )
        proc = multiprocessing.get_context("fork").Process(
            target=serve, args=(config, routing_socket, args.router_core), daemon=True
        )
        proc.start()
        procs.append(proc)
        assert proc.pid is not None
        routers[routing_socket] = (config, proc.pid)
        for i in range(REPLICAS):
            agent = RegistryAgent(
                config.registry_bind,
                p.Register(f"r{i}", MODEL, upstream, block_size=16),
                curve_dir=config.curve_dir,
            )
            agent.register()
            agent.process_replies(5.0)
            agents.append(agent)

    rng = random.Random(1)
    prompts = [
        prompt_block_hashes([rng.randrange(50_000) for _ in range(2048)], 16) for _ in range(50)
    ]
    cases = {
        "route + release": (lambda i, prev: p.Route(i, MODEL), True),
        "route + release, 128 hashes": (
            lambda i, prev: p.Route(
                i, MODEL, block_hashes=prompts[i % 50], block_size=16, prompt_tokens=2048
            ),
            True,
        ),
        "route with release folded in": (
            lambda i, prev: p.Route(i, MODEL, released=[prev] if prev else []),
            False,
        ),
    }
    socks = {}
    for routing_socket, (config, _) in routers.items():
        sock = socks[routing_socket] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if config.curve_dir:  # libzmq's CURVE client with the gateway key
            sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(
                str(Path(config.curve_dir) / "gateway.key_secret")
            )
            sock.curve_serverkey = zmq.auth.load_certificate(
                str(Path(config.curve_dir) / "router.key")
            )[0]
        sock.connect(config.routing_bind)
        measure(sock, cases["route + release"][0], 500, True)  # warm up
    results: dict[str, dict[str, list[float]]] = {}
    for round_no in range(args.rounds):
        for name, (make, release) in cases.items():
            for routing_socket, sock in sorted(socks.items(), reverse=round_no % 2 == 1):
                lat, cpu = measure(sock, make, args.requests, release)
                lat.sort()
                row = results.setdefault(
                    f"{name}, {routing_socket} router", {"p50": [], "p99": [], "cpu": []}
                )
                row["p50"].append(lat[len(lat) // 2] * 1e6)
                row["p99"].append(lat[int(len(lat) * 0.99)] * 1e6)
                row["cpu"].append(cpu * 1e6)
    for sock in socks.values():
        sock.close(0)
    import uvloop

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})
    client_results: dict[str, dict[str, list[float]]] = {}
    for round_no in range(args.rounds):
        for concurrency in (1, 64):
            for routing_socket, (config, pid) in sorted(routers.items(), reverse=round_no % 2 == 1):
                got = uvloop.run(
                    client_case(
                        config.routing_bind, pid, args.requests, concurrency, config.curve_dir
                    )
                )
                row = client_results.setdefault(
                    f"RoutingClient, c={concurrency}, {routing_socket} router", {}
                )
                for key, value in got.items():
                    row.setdefault(key, []).append(value)
    ladder_summary = {}
    try:
        if args.ladder:
            ladder_summary = ladder_case(work, routers, upstream, args)
    finally:
        for agent in agents:
            agent.close()
        for proc in procs:
            proc.terminate()
            proc.join(5)
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
    hints_s = hints_cost()
    summary = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    client_summary = {
        name: {k: statistics.median(v) for k, v in r.items()} for name, r in client_results.items()
    }
    ratios = curve_ratios(summary, client_summary)
    out = {
        "cases_us": summary,
        "gateway_client_us": client_summary,
        "gateway_ladder": ladder_summary,
        "gateway_hints_2k_prompt_p50_us": hints_s * 1e6,
        "curve_over_plain_zmtp": ratios,
    }
    write_results("router_roundtrip", out, {"load_average_before": load_before})
    print("| case (blocking libzmq DEALER) | round trip p50 | p99 | client CPU per request |")
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
    if ladder_summary:
        print()
        print("| gateway (chat, nginx upstream) | p50 | p99 | req/s | gateway CPU / request "
              "| router CPU / request |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for name, r in ladder_summary.items():
            print(f"| {name} | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms | {r['rps']:.0f} "
                  f"| {r['cpu_us']:.0f} us | {r['router_cpu_us']:.0f} us |")  # fmt: skip
    print()
    print("| CURVE / plain ZMTP router, same rounds | round trip or route() p50 | p99 "
          "| client CPU / request | router CPU / request |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, r in ratios.items():
        print(f"| {name} | {r['p50']:.2f} | {r['p99']:.2f} | {r['cpu']:.2f} "
              f"| {r.get('router_cpu', float('nan')):.2f} |")  # fmt: skip
    print(f"\nload average before {load_before}, after {os.getloadavg()}")


def curve_ratios(
    cases: dict[str, dict[str, float]], clients: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Each case's CURVE figures over the plain ZMTP router's (same rounds, interleaved)."""
    out = {}
    for table in (cases, clients):
        for name, row in table.items():
            if not name.endswith("zmtp-curve router"):
                continue
            plain = table[name.replace("zmtp-curve router", "zmtp router")]
            out[name.removesuffix(", zmtp-curve router")] = {
                k: row[k] / plain[k] for k in row if plain.get(k)
            }
    return out


if __name__ == "__main__":
    main()
