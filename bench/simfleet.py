"""A simulated fleet behind the real router and gateway: the harness for fleet benchmarks.

``sim_stack(...)`` starts, as separate processes, the real router (`hpcserve router`,
with the routing policy you choose), the real gateway (`hpcserve gateway`) and one
simulated fleet (`python -m hpcserve.sim.fleet`: N replicas in one process, each with its
own port, registry connection and KV-event publisher); it waits until the router lists all
N replicas and the gateway's own metrics answer, all three processes still running (else
RuntimeError or TimeoutError), and yields a ``SimStack`` with the gateway URL, an API key
and the measured start time. Drive it with bench/workload.py:

    from bench.simfleet import sim_stack
    from bench.workload import SLO, build, run_workload, summarize

    with sim_stack(replicas=64, policy="kv-aware") as stack:
        specs = build("doc-extraction", model=stack.model, rate=40, requests=400,
                      count_tokens=stack.count_tokens)
        results = asyncio.run(run_workload(specs, stack.base_url, model=stack.model,
                                           api_key=stack.api_key))
        print(summarize(results, SLO(ttft_s=0.5, tpot_s=0.05)))
        print(stack.engine_metrics())   # summed vLLM counters of all replicas

The fleet models ``sim_model`` on ``sim_gpu`` (the planner's catalogs) with the tokenizer
of a tiny chat model (made once in the work directory), so the token ids the router hashes
are the ids the engines' KV events carry. As a script it measures the fleet's start time
and serves one workload:

    .venv/bin/python bench/simfleet.py --replicas 64 --workload doc-extraction \\
        --rate 30 --requests 300 [--policy kv-aware] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from bench.workload import SLO, build, run_workload, summarize  # noqa: E402
from hpcserve.config import dump_config, hash_api_key, parse_config  # noqa: E402
from hpcserve.contracts.engine_args import kv_transfer_args  # noqa: E402
from hpcserve.contracts.router_client import list_replicas  # noqa: E402
from tests.ports import free_ports  # noqa: E402

API_KEY = "sk-simfleet-bench"
MODEL = "sim-chat"


@dataclass
class SimStack:
    base_url: str
    api_key: str
    model: str
    model_dir: Path
    routing_endpoint: str
    registry_endpoint: str
    replicas: int
    start_s: float  # fleet process spawned -> router lists every replica
    replica_urls: list[str] = field(default_factory=list)
    _tokenizer: Any = None

    def count_tokens(self, text: str) -> int:
        if self._tokenizer is None:
            from hpcserve.sim.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(str(self.model_dir))
        return len(self._tokenizer.prompt_ids(text))

    def engine_metrics(self) -> dict[str, float]:
        """vLLM counters and gauges summed over every replica's /metrics."""
        totals: dict[str, float] = {}
        for url in self.replica_urls:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
                text = resp.read().decode()
            for line in text.splitlines():
                if line.startswith("vllm:") and "_bucket" not in line and "_created" not in line:
                    name = line.split("{", 1)[0].split(" ", 1)[0]
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals


def _check_running(procs: dict[str, subprocess.Popen[bytes]], logs: Path) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            tail = (logs / f"{name}.log").read_text(errors="replace").splitlines()[-5:]
            raise RuntimeError(f"the {name} exited ({proc.returncode}): " + " | ".join(tail))


def _wait_listed(
    endpoint: str,
    count: int,
    procs: dict[str, subprocess.Popen[bytes]],
    logs: Path,
    timeout_s: float,
) -> list[Any]:
    """Until the router at `endpoint` answers with at least `count` replicas."""
    deadline = time.monotonic() + timeout_s
    listed: list[Any] | None = None
    while time.monotonic() < deadline:
        _check_running(procs, logs)
        with contextlib.suppress(Exception):
            listed = list_replicas(endpoint, timeout_s=1.0)
        if listed is not None and len(listed) >= count:
            return listed
        time.sleep(0.05)
    if listed is None:
        raise TimeoutError(f"the router at {endpoint} did not answer within {timeout_s:g}s")
    raise TimeoutError(f"{len(listed)} of {count} replicas registered after {timeout_s:g}s")


def _wait_gateway(
    base_url: str,
    procs: dict[str, subprocess.Popen[bytes]],
    logs: Path,
    token_file: Path,
    timeout_s: float = 30,
) -> None:
    """Until our gateway answers: its own metrics (behind the metrics token it makes at
    start), not just any server on its port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _check_running(procs, logs)
        if not token_file.exists():
            time.sleep(0.1)
            continue
        token = token_file.read_text().strip()
        request = urllib.request.Request(
            base_url + "/metrics", headers={"Authorization": f"Bearer {token}"}
        )
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(request, timeout=2) as resp,
        ):
            if b"hpcserve_gateway_" in resp.read():
                return
        time.sleep(0.1)
    raise TimeoutError(f"the gateway at {base_url} not up after {timeout_s:g}s")


def tiny_model(work: Path) -> Path:
    from hpcserve.tinymodels import make_tiny_model

    path = work / "tiny-chat"
    if not (path / "tokenizer.json").exists():
        make_tiny_model("chat", path)
    return path


@contextlib.contextmanager
def sim_stack(
    replicas: int = 64,
    *,
    policy: str | None = None,
    routing: dict[str, Any] | None = None,
    sim_gpu: str = "h100",
    sim_model: str = "llama-3.1-8b",
    time_scale: float = 1.0,
    sim_args: list[str] | None = None,
    model_dir: Path | None = None,
    work_dir: Path | None = None,
    start_timeout_s: float = 120.0,
    pd: tuple[int, int] | None = None,
) -> Iterator[SimStack]:
    """Router + gateway + a fleet of ``replicas`` simulated engines; see the module doc.

    ``policy`` sets router.routing.policy; ``routing`` any other router.routing keys.
    ``pd``: (prefill, decode) replicas of a disaggregated model instead (two fleets, pools
    ``MODEL-prefill`` and ``MODEL-decode``, docs/disaggregation.md); ``replicas`` is ignored.
    """
    if pd is not None:
        replicas = sum(pd)
    with contextlib.ExitStack() as stack:
        work = work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        model_path = model_dir or tiny_model(work)
        # From below the ephemeral range: the fleet binds ~200 ephemeral ports while the
        # router and gateway start, and once took the gateway's (the workload then went to
        # one replica directly) or the router's (no replica could register).
        registry_port, routing_port, gw_port = free_ports(3)
        registry = f"tcp://127.0.0.1:{registry_port}"
        routing_ep = f"tcp://127.0.0.1:{routing_port}"
        routing_cfg = dict(routing or {})
        if policy:
            routing_cfg["policy"] = policy
        raw: dict[str, Any] = {
            "state_dir": str(work / "state"),
            "router": {
                "registry_bind": registry,
                "routing_bind": routing_ep,
                "metrics_port": 0,
                "allow_plain_loopback": True,  # the simulated fleet registers without keys
                **({"routing": routing_cfg} if routing_cfg else {}),
            },
            "gateway": {
                "port": gw_port,
                "api_keys": [{"tenant": "bench", "sha256": hash_api_key(API_KEY)}],
            },
            "pools": [
                {
                    "name": MODEL,
                    "model_path": str(model_path),
                    "engine": "sim",
                    "replicas": replicas,
                }
            ]
            if pd is None
            else [
                {
                    "name": f"{MODEL}-{role}",
                    "served_model_name": MODEL,
                    "model_path": str(model_path),
                    "engine": "sim",
                    "role": role,
                    "replicas": n,
                }
                for role, n in zip(("prefill", "decode"), pd, strict=True)
            ],
        }
        config_file = work / "hpcserve.toml"
        config = parse_config(raw)
        config_file.write_text(dump_config(config))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        logs = work / "logs"
        logs.mkdir(exist_ok=True)

        def spawn(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
            out = (logs / f"{name}.log").open("wb")
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            stack.callback(_stop, proc, out)
            return proc

        hpcserve = [sys.executable, "-m", "hpcserve.cli"]
        services = {
            "router": spawn("router", [*hpcserve, "router", "--config", str(config_file)]),
            "gateway": spawn("gateway", [*hpcserve, "gateway", "--config", str(config_file)]),
        }
        base_url = f"http://127.0.0.1:{gw_port}"
        # The router and gateway bind first: the fleet then finds their ports taken when it
        # chooses its own (~130, from the same range).
        _wait_listed(routing_ep, 0, services, logs, timeout_s=60)
        _wait_gateway(base_url, services, logs, Path(config.metrics_token_path()))
        fleet_argv = [
            sys.executable, "-m", "hpcserve.sim.fleet",
            "--router", registry,
            "--served-model-name", MODEL,
            "--model", str(model_path),
            "--sim-gpu", sim_gpu,
            "--sim-model", sim_model,
            "--time-scale", str(time_scale),
            *(sim_args or []),
        ]  # fmt: skip
        started = time.monotonic()
        if pd is None:
            fleet = [*fleet_argv, "--replicas", str(replicas), "--pool", MODEL]
            services["fleet"] = spawn("fleet", fleet)
        else:
            for role, n in zip(("prefill", "decode"), pd, strict=True):
                # The pool manager renders this for a sim pool (contracts/engine_args.py).
                transfer = kv_transfer_args(role, "sim", [])
                fleet = [*fleet_argv, "--replicas", str(n), "--pool", f"{MODEL}-{role}"]
                services[role] = spawn(role, [*fleet, "--role", role, *transfer])
        listed = _wait_listed(routing_ep, replicas, services, logs, start_timeout_s)
        start_s = time.monotonic() - started
        yield SimStack(
            base_url=base_url,
            api_key=API_KEY,
            model=MODEL,
            model_dir=model_path,
            routing_endpoint=routing_ep,
            registry_endpoint=registry,
            replicas=replicas,
            start_s=start_s,
            replica_urls=[r.url for r in listed],
        )


def _stop(proc: subprocess.Popen[bytes], out: Any) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--workload", default="doc-extraction")
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="fleet starts to take the median of")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--slo-ttft-s", type=float, default=1.0)
    ap.add_argument("--slo-tpot-s", type=float, default=0.1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "simfleet.json"))
    args = ap.parse_args()
    import statistics

    starts: list[float] = []
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = tiny_model(work)
        for i in range(args.repeats):
            with sim_stack(
                args.replicas,
                policy=args.policy,
                time_scale=args.time_scale,
                model_dir=model_dir,
                work_dir=work / f"run{i}",
            ) as stack:
                starts.append(stack.start_s)
                print(f"start {i + 1}: {args.replicas} replicas registered in {stack.start_s:.2f}s")
                if i == args.repeats - 1:
                    specs = build(
                        args.workload,
                        model=stack.model,
                        rate=args.rate,
                        requests=args.requests,
                        count_tokens=stack.count_tokens,
                    )
                    results = asyncio.run(
                        run_workload(
                            specs, stack.base_url, model=stack.model, api_key=stack.api_key
                        )
                    )
                    slo = SLO(args.slo_ttft_s, args.slo_tpot_s)
                    summary = asdict(summarize(results, slo))
                    metrics = stack.engine_metrics()
                    summary["engine_prefix_hit_share"] = metrics.get(
                        "vllm:prefix_cache_hits_total", 0
                    ) / max(metrics.get("vllm:prefix_cache_queries_total", 0), 1)
    rows = [
        {
            "replicas": args.replicas,
            "start_median_s": round(statistics.median(starts), 2),
            "start_max_s": round(max(starts), 2),
            "starts": len(starts),
            "workload": args.workload,
            "rate_rps": args.rate,
            "requests": summary.get("requests"),
            "ok": summary.get("ok"),
            "ttft_p50_ms": round(summary.get("ttft_p50_s", 0) * 1e3, 1),
            "tpot_p50_ms": round(summary.get("tpot_p50_s", 0) * 1e3, 1),
            "goodput": round(summary.get("goodput", 0), 3),
            "prefix_hit_share": round(summary.get("engine_prefix_hit_share", 0), 3),
        }
    ]
    print(json.dumps(rows, indent=2))
    out = Path(args.out)
    write_results(out.stem, {"rows": rows, "summary": summary}, directory=out.parent)


if __name__ == "__main__":
    main()
