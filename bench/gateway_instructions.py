"""Instructions per request of the gateway (valgrind's callgrind), against the plain relay and,
with `--baseline DIR`, against another commit's gateway: a count that the host's other load
does not move, for changes too small for bench/proxy_overhead.py's timings to resolve on a
shared machine.

Targets (`--targets`, proxy_overhead's feature ladder), each its own process under
`valgrind --tool=callgrind --instr-atstart=no` (started at full speed, counted only while
measured):
  relay          bench/proxy_overhead.py's plain relay (Starlette + the gateway's HTTP client)
  auth ... hints  proxy_overhead's rungs; from `routing` on, the router is a process of its
                 own (not under valgrind: its instructions are not counted)
  embedded       the gateway with every feature on and the router in its process (as
                 proxy_overhead's `+ embedded`: auth, quotas, routing with prefix hints on the
                 32k-entry tokenizer, metrics, audit log, usage records): counted whole
  embedded@base  the same from the hpcserve package in DIR (bench/baseline_package.sh REV DIR)
Upstream: proxy_overhead's nginx (a fixed completion, or its 16-event SSE stream). Per case
(chat: a non-streamed chat request; stream: the same streamed) and round, each target gets
`--warmup` requests, its counters are zeroed (callgrind_control -z), it serves `--requests`
requests one at a time on one kept-alive connection (concurrency 1; a new number in each
request's last turn, as proxy_overhead's case "chat"), and the count is dumped. Counted: the
target's user-space instructions, every thread (the embedded router's, the usage writer's);
not the kernel's work for its syscalls, so this is the Python and native code of the path,
not its whole CPU time. Medians over `--rounds`.

    .venv/bin/python bench/gateway_instructions.py [--requests 300] [--rounds 2]
        [--targets relay,auth,...,embedded] [--baseline DIR]

Needs valgrind and nginx. Prints a markdown table and writes
bench/results/gateway_instructions.json.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.proxy_overhead as po  # noqa: E402
from bench.results import write_results  # noqa: E402
from hpcserve.config import dump_config, parse_config  # noqa: E402
from hpcserve.contracts import protocol as p  # noqa: E402
from hpcserve.engine_launch.agent import RegistryAgent  # noqa: E402
from tests.ports import free_port  # noqa: E402

CASES = ("chat", "stream")


class Target:
    """One gateway (or the relay) under callgrind."""

    def __init__(self, name: str, feature: str, work: Path, upstream: str, model_dir: str,
                 env: dict[str, str], router: dict[str, Any]) -> None:  # fmt: skip
        """router: the router process's config, which an `embedded` target replaces by its
        own in-process router's."""
        self.name = name
        self.port = free_port()
        config, self.registry = po.gateway_config(feature, self.port, router, work / "state")
        path = work / f"gateway-{name}.toml"
        path.write_text(dump_config(config))
        self.out = str(work / f"callgrind-{name}")
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={self.out}", sys.executable,
             str(ROOT / "bench" / "proxy_overhead.py"), "--serve-gateway", str(path), feature,
             upstream, model_dir, "one-send"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def control(self, *flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, str(self.proc.pid)], check=True,
                       capture_output=True)  # fmt: skip

    def last_dump(self) -> int:
        """The instructions in the newest dump."""
        newest = max(glob.glob(self.out + ".*"), key=os.path.getmtime)
        with open(newest) as f:
            for line in f:
                if line.startswith("summary:"):
                    return int(line.split()[1])
        raise RuntimeError(f"{newest}: no summary line")


def wait_up(port: int, path: str, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", path)
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"port {port}: nothing answers {path} after {limit_s:.0f} s")


class Client:
    """Requests one at a time on one connection, each with a number never sent before."""

    def __init__(self) -> None:
        conversations = po.chat_conversations()
        self.bodies = {
            "chat": [po.chat_body(m, stream=False) for m in conversations],
            "stream": [po.chat_body(m, stream=True) for m in conversations],
        }
        self.counter = 10_000_000

    def run(self, port: int, case: str, n: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {po.KEY}"}
        if case == "stream":
            headers["X-Request-Id"] = po.STREAM_MARK
        bodies = self.bodies[case]
        for i in range(n):
            self.counter += 1
            body = bodies[i % len(bodies)].replace(po.COUNTER.encode(), b"%d" % self.counter)
            conn.request("POST", "/v1/chat/completions", body, headers)
            answer = conn.getresponse()
            data = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"{case}: {answer.status} {data[:300]!r}")
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--targets",
        default="relay,embedded",
        help=f"of {','.join(po.FEATURES)}: comma-separated (the relay is always measured)",
    )
    parser.add_argument(
        "--baseline",
        default="",
        help="a directory holding another commit's hpcserve package "
        "(bench/baseline_package.sh REV DIR): measured as embedded@base",
    )
    args = parser.parse_args()
    for tool in ("valgrind", "callgrind_control", "nginx"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is needed (Debian packages valgrind, nginx-light)")

    work = Path(tempfile.mkdtemp(prefix="hpcserve-instructions-"))
    upstream_port = free_port()
    nginx = subprocess.Popen(["nginx", "-p", str(work), "-c",
                              str(po.nginx_config(work, upstream_port))])  # fmt: skip
    upstream = f"http://127.0.0.1:{upstream_port}"
    model_dir = str(po.bench_model_dir(Path(tempfile.gettempdir())))
    names = ["relay", *(t for t in args.targets.split(",") if t and t != "relay")]
    unknown = [t for t in names if t not in po.FEATURES]
    if unknown:
        sys.exit(f"--targets: unknown {', '.join(unknown)} (of {', '.join(po.FEATURES)})")
    plans = [(name, name, dict(os.environ)) for name in names]
    if args.baseline:
        base = str(Path(args.baseline).resolve())
        plans.append(("embedded@base", "embedded", {**os.environ, po.BASELINE_ENV: base}))
    router: dict[str, Any] = {
        "registry_bind": f"tcp://127.0.0.1:{free_port()}",
        "routing_bind": f"tcp://127.0.0.1:{free_port()}",
        "metrics_port": 0,
        "allow_plain_loopback": True,
    }
    processes: list[subprocess.Popen[bytes]] = []
    if any(po.FEATURES.index(n) >= po.FEATURES.index("routing") for n in names if n != "embedded"):
        path = work / "router.toml"
        path.write_text(dump_config(parse_config({"state_dir": str(work / "state"),
                                                  "router": router})))  # fmt: skip
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "hpcserve.cli", "router", "--config", str(path)], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
    targets = [Target(name, feature, work, upstream, model_dir, env, router)
               for name, feature, env in plans]  # fmt: skip
    registries = {t.registry for t in targets if t.registry} | (
        {router["registry_bind"]} if processes else set()
    )
    agents = [
        RegistryAgent(registry, p.Register(f"bench-{n}", po.MODEL, upstream))
        for registry in sorted(registries)
        for n in ("a", "b")  # two replicas: the prefix hints count
    ]
    stop = threading.Event()
    beat = threading.Thread(target=po.keep_registered, args=(agents, stop), daemon=True)
    client = Client()
    counts: dict[tuple[str, str], list[float]] = {}
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        for target in targets:
            wait_up(target.port, "/v1/models" if target.name == "relay" else "/health")
        beat.start()  # once every router answers (under valgrind they start in minutes)
        time.sleep(3)  # every replica in every gateway's routing view
        for round_no in range(args.rounds):
            for case in CASES:
                for target in targets:
                    target.control("-i", "on")
                    client.run(target.port, case, args.warmup)
                    target.control("-z")
                    client.run(target.port, case, args.requests)
                    target.control("-d")
                    target.control("-i", "off")
                    per_request = target.last_dump() / args.requests
                    counts.setdefault((case, target.name), []).append(per_request)
                    print(f"round {round_no + 1} {case:6s} {target.name:13s} "
                          f"{per_request:12,.0f} instructions/request", file=sys.stderr,
                          flush=True)  # fmt: skip
    finally:
        stop.set()
        for target in targets:
            target.proc.terminate()
        for target in targets:
            target.proc.wait(30)
        nginx.terminate()
        for process in processes:
            process.terminate()
        beat.join(3)
        for agent in agents:
            agent.close()

    rows: list[dict[str, Any]] = []
    print("\n| case | target | instructions per request | / relay's | / embedded@base's |")
    print("|---|---|---|---|---|")
    for case in CASES:
        med = {name: statistics.median(v) for (c, name), v in counts.items() if c == case}
        for name, value in med.items():
            vs_relay = value / med["relay"]
            vs_base = value / med["embedded@base"] if "embedded@base" in med else None
            rows.append({"case": case, "target": name, "instructions": round(value),
                         "vs_relay": round(vs_relay, 3),
                         **({"vs_base": round(vs_base, 3)} if vs_base else {})})  # fmt: skip
            print(f"| {case} c=1 | {name} | {value:,.0f} | {vs_relay:.2f}x | "
                  + (f"{vs_base:.3f}x |" if vs_base else "- |"))  # fmt: skip
    write_results(
        "gateway_instructions",
        {"rows": rows},
        {"requests": args.requests, "rounds": args.rounds, "warmup": args.warmup,
         "baseline": args.baseline, "load_before": load_before,
         "seconds": round(time.monotonic() - started)},
    )  # fmt: skip


if __name__ == "__main__":
    main()
