"""What the gateway adds to a request, and aiohttp against httpx as its upstream client.

Side by side in one run, interleaved, medians of ROUNDS:
  direct   wrk -> upstream                                   (the floor)
  aiohttp  wrk -> hpcserve gateway (aiohttp relay) -> upstream (what we ship)
  httpx    wrk -> hpcserve gateway (httpx relay)   -> upstream (the alternative)
Each gateway is the real one: API-key check, a real router over ZeroMQ picking the
replica, the relay, metrics. The upstream is a fixed-response ASGI server standing in
for vLLM, so the proxy is what is measured; it and wrk share one core, the gateway is
pinned to the other.

    .venv/bin/python bench/proxy_overhead.py [--rounds 3] [--seconds 5]

Needs wrk (Debian package `wrk`). Prints a markdown table and writes bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpcserve.config import dump_config, hash_api_key, parse_config  # noqa: E402
from hpcserve.engine_launch.agent import RegistryAgent  # noqa: E402
from hpcserve.router import protocol as p  # noqa: E402
from tests.ports import free_port  # noqa: E402

KEY = "sk-bench"
MODEL = "bench-model"
CHAT_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You extract fields from shipping documents. " * 8},
            {"role": "user", "content": "Bill of lading 4711: consignee ACME GmbH. " * 10},
        ],
        "max_tokens": 64,
    }
).encode()
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "consignee: ACME GmbH" * 4},
            }
        ],
        "usage": {"prompt_tokens": 300, "completion_tokens": 20, "total_tokens": 320},
    }
).encode()
SSE = (
    b"".join(
        b'data: {"id":"c","object":"chat.completion.chunk","model":"bench-model","choices":'
        b'[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
        for _ in range(16)
    )
    + b"data: [DONE]\n\n"
)


# -- the stand-in upstream ---------------------------------------------------------------


async def upstream_app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if b'"stream": true' in body or b'"stream":true' in body:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for chunk in SSE.split(b"\n\n")[:-1]:
            await send({"type": "http.response.body", "body": chunk + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": COMPLETION})


# -- the httpx relay, for comparison only ------------------------------------------------


def httpx_relay(upstream_timeout_s: float):  # type: ignore[no-untyped-def]
    import httpx
    from starlette.background import BackgroundTask
    from starlette.responses import Response, StreamingResponse

    class HttpxRelay:
        def __init__(self) -> None:
            self._client: httpx.AsyncClient | None = None

        async def start(self) -> None:
            self._client = httpx.AsyncClient(
                timeout=upstream_timeout_s, limits=httpx.Limits(max_connections=None)
            )

        async def close(self) -> None:
            assert self._client is not None
            await self._client.aclose()

        async def forward(self, url, body, request_headers, *, stream, on_done):  # type: ignore[no-untyped-def]
            assert self._client is not None
            request = self._client.build_request(
                "POST", url, content=body, headers={"Content-Type": "application/json"}
            )
            upstream = await self._client.send(request, stream=True)
            if not stream:
                payload = await upstream.aread()
                await upstream.aclose()
                on_done()
                return Response(
                    payload,
                    status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type"),
                )

            async def chunks():  # type: ignore[no-untyped-def]
                async for chunk in upstream.aiter_raw():
                    yield chunk
                await upstream.aclose()

            return StreamingResponse(
                chunks(),
                status_code=upstream.status_code,
                media_type="text/event-stream",
                background=BackgroundTask(on_done),
            )

    return HttpxRelay()


def serve_gateway(config_path: str, client: str) -> None:
    import uvicorn

    from hpcserve.config import load_config
    from hpcserve.gateway.app import Gateway, build_app

    config = load_config(Path(config_path))
    relay = httpx_relay(config.gateway.upstream_timeout_s) if client == "httpx" else None
    gateway = Gateway(
        config.gateway,
        routing_endpoint=config.router.gateways_dial(),
        configured_models={MODEL},
        relay=relay,
    )
    uvicorn.run(
        build_app(gateway),
        host="127.0.0.1",
        port=config.gateway.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


# -- the driver ---------------------------------------------------------------------------


def wait_http(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def run_wrk(url: str, body_file: Path, connections: int, seconds: int) -> dict[str, float]:
    lua = body_file.with_suffix(".lua")
    lua.write_text(
        'wrk.method = "POST"\n'
        f'wrk.body = io.open("{body_file}"):read("*a")\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {KEY}"\n'
    )
    out = subprocess.run(
        [
            "taskset",
            "-c",
            "1",
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--latency",
            "-s",
            str(lua),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert p50 and rps, out
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)]
    return {"p50_ms": float(p50.group(1)) * scale, "rps": float(rps.group(1))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument(
        "--serve-gateway", nargs=2, metavar=("CONFIG", "CLIENT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve_gateway:
        serve_gateway(*args.serve_gateway)
        return
    if not shutil.which("wrk"):
        sys.exit("wrk is needed: apt-get install wrk")

    work = Path(tempfile.mkdtemp(prefix="hpcserve-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    upstream_port = free_port()
    py = sys.executable

    def spawn(argv: list[str], core: str) -> None:
        procs.append(
            subprocess.Popen(
                ["taskset", "-c", core, *argv],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    try:
        spawn(
            [
                py,
                "-m",
                "uvicorn",
                "bench.proxy_overhead:upstream_app",
                "--port",
                str(upstream_port),
                "--loop",
                "uvloop",
                "--http",
                "httptools",
                "--no-access-log",
                "--log-level",
                "warning",
            ],
            "1",
        )
        gateways = {}
        router_cfg = {
            "registry_bind": f"tcp://127.0.0.1:{free_port()}",
            "routing_bind": f"tcp://127.0.0.1:{free_port()}",
            "metrics_port": 0,
        }
        config = parse_config(
            {
                "router": router_cfg,
                "gateway": {"api_keys": [{"tenant": "bench", "sha256": hash_api_key(KEY)}]},
            }
        )
        (work / "router.toml").write_text(dump_config(config))
        spawn([py, "-m", "hpcserve.cli", "router", "--config", str(work / "router.toml")], "1")
        for client in ("aiohttp", "httpx"):
            port = free_port()
            cfg = parse_config(
                {
                    "router": router_cfg,
                    "gateway": {
                        "port": port,
                        "api_keys": [{"tenant": "bench", "sha256": hash_api_key(KEY)}],
                    },
                }
            )
            path = work / f"gateway-{client}.toml"
            path.write_text(dump_config(cfg))
            spawn(
                [
                    py,
                    str(ROOT / "bench" / "proxy_overhead.py"),
                    "--serve-gateway",
                    str(path),
                    client,
                ],
                "0",
            )
            gateways[client] = f"http://127.0.0.1:{port}"
        upstream = f"http://127.0.0.1:{upstream_port}"
        wait_http(upstream + "/")
        for url in gateways.values():
            wait_http(url + "/health")

        agent = RegistryAgent(
            router_cfg["registry_bind"], p.Register("bench-replica", MODEL, upstream)
        )
        stop = threading.Event()

        def heartbeat() -> None:
            agent.register()
            while not stop.is_set():
                agent.heartbeat(p.ReplicaLoad())
                agent.process_replies(1.0)

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        time.sleep(1.5)

        bodies = {"chat": work / "chat.json", "stream": work / "stream.json"}
        bodies["chat"].write_bytes(CHAT_BODY)
        bodies["stream"].write_bytes(CHAT_BODY[:-1] + b', "stream": true}')
        targets = {"direct": upstream, **gateways}
        cases = [("chat", 1), ("chat", 32), ("stream", 1), ("stream", 32)]
        results: dict[str, dict[str, list[dict[str, float]]]] = {}
        for round_no in range(args.rounds):
            for case, conns in cases:
                for name, base in targets.items():
                    key = f"{case} c={conns}"
                    r = run_wrk(base + "/v1/chat/completions", bodies[case], conns, args.seconds)
                    results.setdefault(key, {}).setdefault(name, []).append(r)
                    print(
                        f"round {round_no + 1} {key:12s} {name:8s} p50 {r['p50_ms']:7.2f} ms"
                        f"  {r['rps']:8.0f} req/s",
                        file=sys.stderr,
                        flush=True,
                    )
        stop.set()
        beat.join(3)
        agent.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)

    rows = []
    print("\n| case | target | p50 latency | added p50 vs direct | req/s | req/s vs aiohttp |")
    print("|---|---|---|---|---|---|")
    for key, by_target in results.items():
        med = {
            name: {m: statistics.median(r[m] for r in runs) for m in ("p50_ms", "rps")}
            for name, runs in by_target.items()
        }
        for name, m in med.items():
            added = m["p50_ms"] - med["direct"]["p50_ms"]
            ratio = m["rps"] / med["aiohttp"]["rps"]
            print(
                f"| {key} | {name} | {m['p50_ms']:.2f} ms | "
                f"{'-' if name == 'direct' else f'+{added:.2f} ms'} | {m['rps']:.0f} | "
                f"{ratio:.2f}x |"
            )
            rows.append({"case": key, "target": name, **m})
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "command": " ".join(["bench/proxy_overhead.py", *sys.argv[1:]]),
        "rounds": args.rounds,
        "seconds": args.seconds,
    }
    (out_dir / "proxy_overhead.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
