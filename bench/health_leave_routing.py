"""How fast a replica leaves routing after its GPU reports an Xid (issue 7: under 3 s).

A real router (in this process, real ZeroMQ) and a real `hpcserve engine --engine sim`
subprocess with the fake NVML; each trial starts an engine, waits until it serves, writes
an Xid 79 into its GPU state file and polls `ListReplicas` every 5 ms until the replica is
gone. Measured from the write, so it includes the monitor's detection (the Xid watcher's
event wait) on top of what the issue times (detection -> out of routing); the engine's
log gives detection -> HealthReport sent. Compared side by side with the lease alone
(SIGKILL of the engine: the replica goes only when its lease lapses).

    .venv/bin/python bench/health_leave_routing.py [--trials 5]

Prints a markdown table and writes bench/results/health_leave_routing.json.
"""

from __future__ import annotations

import argparse
import json
import os
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

from bench.results import write_results  # noqa: E402
from hpcserve.config import RouterConfig  # noqa: E402
from hpcserve.contracts.router_client import list_replicas  # noqa: E402
from hpcserve.router.server import RouterServer  # noqa: E402
from tests.ports import free_port  # noqa: E402

LEASE_S, HEARTBEAT_S = 6.0, 2.0  # the config defaults


def start_router() -> RouterServer:
    config = RouterConfig(
        registry_bind=f"tcp://127.0.0.1:{free_port()}",
        routing_bind=f"tcp://127.0.0.1:{free_port()}",
        lease_s=LEASE_S,
        heartbeat_s=HEARTBEAT_S,
        metrics_port=0,
        allow_plain_loopback=True,  # one user's benchmark on loopback
    )
    server = RouterServer(config)
    server.bind()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.ready.wait(5)
    return server


def write_gpus(path: Path, xids: list[int]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [{}, {}, {}, {"xids": xids}]}))
    tmp.replace(path)


def trial(router: RouterServer, work: Path, kill: bool) -> float:
    state = work / "nvml.json"
    write_gpus(state, [])
    env = {**os.environ, "HPCSERVE_FAKE_NVML": str(state)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "sim",
         "--model-path", "/nonexistent", "--served-model-name", "m",
         "--router", router.config.registry_bind, "--bind-host", "127.0.0.1",
         "--advertise-host", "127.0.0.1", "--heartbeat-s", str(HEARTBEAT_S), "--drain-s", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    routing = router.config.routing_bind
    try:
        deadline = time.monotonic() + 60
        while not list_replicas(routing):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the engine did not register")
            time.sleep(0.05)
        time.sleep(1.0)  # the monitor is up (it starts right after registration)
        started = time.monotonic()
        if kill:
            proc.send_signal(signal.SIGKILL)
        else:
            write_gpus(state, [79])
        while list_replicas(routing):
            time.sleep(0.005)
        return time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    router = start_router()
    results: dict[str, list[float]] = {"xid 79 (health report)": [], "SIGKILL (lease only)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.trials):  # interleaved
            results["xid 79 (health report)"].append(trial(router, Path(tmp), kill=False))
            results["SIGKILL (lease only)"].append(trial(router, Path(tmp), kill=True))
    router.stop()
    print(f"lease_s={LEASE_S} heartbeat_s={HEARTBEAT_S}, {args.trials} trials each\n")
    print("| how the replica goes | median s | min s | max s |")
    print("|---|---:|---:|---:|")
    for name, values in results.items():
        print(
            f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |"
        )
    write_results(
        "health_leave_routing",
        {"lease_s": LEASE_S, "heartbeat_s": HEARTBEAT_S, "seconds": results},
        {"trials": args.trials},
    )


if __name__ == "__main__":
    main()
