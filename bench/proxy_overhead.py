"""What the gateway adds to a request, feature by feature, side by side in one run.

Targets, interleaved, medians of ROUNDS:
  direct    wrk -> upstream                                        (the floor)
  relay     wrk -> Starlette + pooled aiohttp, nothing else -> upstream (a Python proxy's floor)
  + auth    the hpcserve gateway: key check, body validation, relay (static upstream, no
            router, metrics off)
  + quotas  + a tenant with limits: admission, usage counting, the quota sync to the router
  + routing + the real router over ZeroMQ (Route, Release) instead of a static upstream
  + metrics + Prometheus metrics
  + audit   + the audit log (gateway.audit_log): one JSON line per request, to a file
  + usage   + the usage records (gateway.usage_dir, always on in a deployment): one JSON
            line per answer, appended to the day's file, synced at most every second
  + tracing + request spans (exported by the gateway's background thread to an exporter that
            drops them): everything on
  + hints-cold  + prefix hints for KV-aware routing (2 replicas, so they count) with the prompt
            cache off: every prompt rendered with its chat template, tokenized and hashed
  + hints-every  + hints as below, but every block's hash sent (gateway.prefix_hash_tokens
            at one block: the Route before sampled hashes)
  + hints   + the prompt cache on (gateway.prompt_cache_mb), a short new last turn not
            tokenized the first time (gateway.prompt_defer_chars) and one hash per 64 tokens
            (gateway.prefix_hash_tokens): the default deployment, every feature but tracing on
  + embedded  + hints as above, with the router in the gateway's process (gateway.embed_router:
            a Route is a call, no router process; the gateway's CPU includes the router's)
  sglang-router, vllm-router  the Rust routers' cache_aware policy, when `--rust-venv` names
            a virtual environment they are installed in (never the project's)
  FEATURE@base  with `--baseline DIR`: each selected gateway but the plain relay once more,
            from the hpcserve package in DIR (another commit, installed there by
            bench/baseline_package.sh), in the same rounds: an A/B of two versions of the code
            that the host's drift between runs does not skew
Bodies (the default, `--bodies chat`): chat requests of 1k-4k tokens for a realistic
tokenizer (byte-level BPE, 32k entries, trained here on generated text, Llama-3 special tokens
and chat template): 16 conversations over 4 shared system prompts with multi-turn histories;
wrk cycles through them and puts a new number into each request's last user turn, so the
gateway sees a new last turn every time (case "chat"), or, in case "repeat", the same bodies
again (a prompt cache holds them whole). `--bodies small`: the old fixed ~1.2 KB body.
The upstream answers with fixed bytes, so the proxy is what is measured: nginx by default
(`return 200` with a fixed completion, or, for a request marked `X-Request-Id: bench-stream`,
the 16-event SSE body vLLM streams for the gateway's request: the usage so far on every
event, then the usage event and [DONE]); `--upstream python` uses a fixed-response ASGI app
instead (when nginx is not installed). Each proxy is pinned to core 0 with the router
(`--router-core`): the gateway and its router are the proxy, as a Rust router is one
process doing both; wrk and the upstream share core 1. Per target: p50/p99 at concurrency 1
and N, requests/s (the proxy has one core, so this is per core) and the proxy's CPU time
per request (from /proc, less sensitive to the machine's other load than req/s): for a
gateway, its own and the router's (heartbeats included) while the target ran, the router's
share also given alone, and the kernel's share (system time: the sockets' and files' work
for the proxy's system calls). The machine's load average before and after is printed with the
table. `--syscalls`: each target's system calls per request instead (strace -c attached to
its process and, for the rungs with one, the router's, while wrk runs; by name, the five
most frequent shown; strace slows the traced process, so that run's timings are not the
proxy's), into bench/results/proxy_overhead_syscalls.json.

    .venv/bin/python bench/proxy_overhead.py [--rounds 3] [--seconds 5] [--concurrency 64]
        [--upstream nginx|python] [--only relay,tracing] [--bodies chat|small]
        [--cases chat1,chat,stream1,stream,repeat] [--rust-venv DIR] [--router-core 0]
        [--gateway-http one-send|httptools] [--baseline DIR] [--syscalls]

Needs wrk (Debian package `wrk`), by default nginx (`nginx-light`), and for `--syscalls`
strace. Prints a markdown
table and writes bench/results/proxy_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# A FEATURE@base gateway (--baseline): its hpcserve package comes before this checkout's.
BASELINE_ENV = "HPCSERVE_BENCH_BASELINE"
if os.environ.get(BASELINE_ENV):
    sys.path.insert(0, os.environ[BASELINE_ENV])

from bench.http_wait import wait_http  # noqa: E402
from bench.results import write_results  # noqa: E402
from hpcserve.config import PlatformConfig, dump_config, hash_api_key, parse_config  # noqa: E402
from hpcserve.contracts import protocol as p  # noqa: E402
from hpcserve.engine_launch.agent import RegistryAgent  # noqa: E402
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
_USAGE = b'"usage":{"prompt_tokens":300,"total_tokens":%d,"completion_tokens":%d}'
# What vLLM streams for the gateway's request (include_usage + continuous_usage_stats): 16
# token events, each with the usage so far, then the usage-only event and [DONE].
SSE = (
    b"".join(
        b'data: {"id":"c","object":"chat.completion.chunk","model":"bench-model","choices":'
        b'[{"index":0,"delta":{"content":"tok"},"finish_reason":null}],'
        + _USAGE % (300 + i, i)
        + b"}\n\n"
        for i in range(1, 17)
    )
    + b'data: {"id":"c","object":"chat.completion.chunk","model":"bench-model","choices":[],'
    + _USAGE % (316, 16)
    + b"}\n\n"
    + b"data: [DONE]\n\n"
)
# wrk marks a streamed request with this X-Request-Id (forwarded by every proxy measured), so
# that nginx, which does not read bodies, knows which fixed answer to give.
STREAM_MARK = "bench-stream"


# -- a realistic tokenizer and chat workload -----------------------------------------------

VOCAB = 32768
BLOCK_SIZE = 16  # vLLM's default KV block
COUNTER = "@@N@@"  # wrk puts a request counter here (the last user turn)
_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cl",
    "dr",
    "fl",
    "gr",
    "pl",
    "qu",
    "sh",
    "st",
    "th",
    "tr",
]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "rk", "st", "x"]


class _Text:
    """Generated English-like text: Zipf-distributed invented words (numpy, seeded)."""

    def __init__(self, seed: int = 23, words: int = 60_000) -> None:
        import numpy as np

        self.rng = np.random.default_rng(seed)
        rng = self.rng
        lexicon = []
        for _ in range(words):
            syllables = int(rng.integers(1, 5))
            lexicon.append("".join(
                _ONSETS[rng.integers(len(_ONSETS))] + _NUCLEI[rng.integers(len(_NUCLEI))]
                + _CODAS[rng.integers(len(_CODAS))] for _ in range(syllables)
            ))  # fmt: skip
        self.lexicon = np.array(lexicon, dtype=object)
        weights = 1.0 / np.arange(1, words + 1)
        self.p = weights / weights.sum()

    def words(self, n: int) -> list[str]:
        return list(self.lexicon[self.rng.choice(len(self.lexicon), size=n, p=self.p)])

    def sentences(self, n_words: int) -> str:
        words = self.words(n_words)
        for i in range(11, len(words), 12):
            words[i] += "."
        return " ".join(words)


def bench_model_dir(work: Path) -> Path:
    """tokenizer.json (byte-level BPE of VOCAB entries trained on generated text, Llama-3
    special tokens) and tokenizer_config.json (the Llama-3 chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    from hpcserve.tinymodels import CHAT_SPECIAL_TOKENS, EOT, LLAMA3_CHAT_TEMPLATE

    out = work / f"bench-model-{VOCAB}-v1"
    if (out / "tokenizer_config.json").exists():  # made by an earlier run: deterministic
        return out
    out.mkdir(parents=True, exist_ok=True)
    text = _Text(seed=11)
    lines = [text.sentences(24) + f" {i}" for i in range(80_000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": CHAT_SPECIAL_TOKENS[0], "eos_token": EOT,
              "chat_template": LLAMA3_CHAT_TEMPLATE}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def chat_conversations(n: int = 16, systems: int = 4, seed: int = 5) -> list[list[dict[str, str]]]:
    """`n` conversations over `systems` shared system prompts, 1k-4k tokens each with the
    bench tokenizer; the last user turn holds COUNTER."""
    text = _Text(seed=seed)
    rng = text.rng
    prompts = [text.sentences(int(rng.integers(220, 380))) for _ in range(systems)]
    conversations = []
    for i in range(n):
        messages = [{"role": "system", "content": prompts[i % systems]}]
        for _ in range(int(rng.integers(1, 11))):
            messages.append({"role": "user", "content": text.sentences(int(rng.integers(15, 60)))})
            messages.append(
                {"role": "assistant", "content": text.sentences(int(rng.integers(20, 90)))}
            )
        ask = text.sentences(int(rng.integers(10, 40)))
        messages.append({"role": "user", "content": f"Question {COUNTER}: {ask}"})
        conversations.append(messages)
    return conversations


def chat_body(messages: list[dict[str, str]], *, stream: bool) -> bytes:
    body = {"model": MODEL, "messages": messages, "max_tokens": 64}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


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
    headers = dict(scope["headers"])
    if headers.get(b"x-request-id") == STREAM_MARK.encode():
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


def nginx_config(work: Path, port: int) -> Path:
    """nginx answering every POST with the fixed completion, or the SSE body when marked."""
    (work / "logs").mkdir(exist_ok=True)
    conf = work / "nginx.conf"

    def quoted(body: bytes) -> str:
        text = body.decode()
        assert "'" not in text
        return "'" + text + "'"

    conf.write_text(
        f"""daemon off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/logs/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {work}/body;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    tcp_nodelay on;
    server {{
        listen 127.0.0.1:{port} reuseport;
        location / {{
            if ($http_x_request_id = "{STREAM_MARK}") {{
                rewrite ^ /stream-answer last;
            }}
            default_type application/json;
            return 200 {quoted(COMPLETION)};
        }}
        location = /stream-answer {{
            internal;
            default_type text/event-stream;
            return 200 {quoted(SSE)};
        }}
    }}
}}
"""
    )
    return conf


# -- the feature ladder: the same gateway with features switched on one at a time ---------

FEATURES = (
    "relay", "auth", "quotas", "routing", "metrics", "audit", "usage", "hints-cold",
    "hints-every", "hints", "tracing", "embedded",
)  # fmt: skip
RUST_ROUTERS = ("sglang-router", "vllm-router")


class _NullMetric:
    """Stands in for every metric when metrics are off (bench only)."""

    def labels(self, *args: object) -> _NullMetric:
        return self

    def inc(self, *args: object) -> None:
        pass

    dec = observe = set = inc


class _NullMetrics:
    def __getattr__(self, name: str) -> _NullMetric:
        return _NullMetric()


class _StaticRouting:
    """Every request to one upstream, no router (bench only: the 'routing' rung adds it)."""

    def __init__(self, url: str) -> None:
        from hpcserve.contracts import protocol as p

        self.reply = p.RouteReply(0, "static", url)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def route(self, model: str, **kwargs: object):  # type: ignore[no-untyped-def]
        return self.reply

    def release(self, replica_id: str, *args: object) -> None:
        pass

    async def sync_quota(self, gateway_id, usage):  # type: ignore[no-untyped-def]
        from hpcserve.contracts import protocol as p

        return p.QuotaTotals(0)


def plain_relay_app(upstream: str):  # type: ignore[no-untyped-def]
    """The floor for a Python proxy: Starlette + one pooled aiohttp session, nothing else."""
    import aiohttp
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    session: dict[str, aiohttp.ClientSession] = {}

    async def relay(request):  # type: ignore[no-untyped-def]
        body = await request.body()
        headers = {"Content-Type": "application/json"}
        request_id = request.headers.get("x-request-id")
        if request_id is not None:
            headers["x-request-id"] = request_id
        upstream_response = await session["s"].post(
            upstream + "/v1/chat/completions", data=body, headers=headers
        )
        if b'"stream": true' not in body:
            payload = await upstream_response.read()
            upstream_response.release()
            return Response(payload, upstream_response.status, media_type="application/json")
        return StreamingResponse(
            upstream_response.content.iter_any(),
            media_type="text/event-stream",
            background=BackgroundTask(upstream_response.release),
        )

    async def lifespan(app):  # type: ignore[no-untyped-def]
        session["s"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        yield
        await session["s"].close()

    return Starlette(
        routes=[Route("/v1/chat/completions", relay, methods=["POST"])], lifespan=lifespan
    )


def serve_gateway(
    config_path: str, feature: str, upstream: str, model_dir: str, http: str = "one-send"
) -> None:
    import uvicorn

    from hpcserve.config import load_config
    from hpcserve.gateway.http_protocol import OneSendHttpProtocol

    config = load_config(Path(config_path))
    if feature == "relay":
        app = plain_relay_app(upstream)
    else:
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        from hpcserve.gateway.app import Gateway, build_app
        from hpcserve.gateway.tracing import Tracing

        class DropSpans(SpanExporter):
            def export(self, spans):  # type: ignore[no-untyped-def]
                return SpanExportResult.SUCCESS

        # + embedded is + hints with the router in this process, not a rung above tracing.
        rung = FEATURES.index("hints" if feature == "embedded" else feature)
        routing = None
        if feature == "embedded":
            from hpcserve.cli import embedded_router
            from hpcserve.gateway.embedded_router import EmbeddedRouting

            routing = EmbeddedRouting(embedded_router(config))
        audit_log = str(Path(config_path).parent / f"audit-{feature}.log")
        gateway = Gateway(
            msgspec.structs.replace(
                config.gateway,
                audit_log=audit_log if rung >= FEATURES.index("audit") else "",
                usage_dir=(
                    str(Path(config_path).parent / f"usage-{feature}")
                    if rung >= FEATURES.index("usage")
                    else ""
                ),
            ),
            routing_endpoint=config.router.gateways_dial(),
            routing=routing,
            configured_models={MODEL},
            tracing=Tracing(exporter=DropSpans()) if rung >= FEATURES.index("tracing") else None,
        )
        if rung < FEATURES.index("routing"):
            gateway.routing = _StaticRouting(upstream)  # type: ignore[assignment]
        if rung < FEATURES.index("metrics"):
            gateway.metrics = _NullMetrics()  # type: ignore[assignment]
        if rung >= FEATURES.index("hints-cold"):
            from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints, hash_stride
            from hpcserve.gateway.route_hints import register_cache_metrics

            hints = RouteHints()
            cache_bytes = 0 if feature == "hints-cold" else config.gateway.prompt_cache_mb << 20
            stride = (
                1
                if feature == "hints-every"
                else hash_stride(config.gateway.prefix_hash_tokens, BLOCK_SIZE)
            )
            hints.add_model(
                MODEL,
                PromptTokenizer.from_dir(model_dir),
                BLOCK_SIZE,
                cache_bytes,
                config.gateway.prompt_defer_chars,
                stride,
            )
            gateway.route_hints = hints
            register_cache_metrics(gateway.metrics_registry, hints)
        app = build_app(gateway)
        from hpcserve.gateway.gc_tune import tune_gc

        tune_gc()  # as gateway/server.py does before serving
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=config.gateway.port,
        loop="uvloop",
        # as gateway/server.py (one send per answer); the plain relay as uvicorn comes
        http="httptools" if feature == "relay" or http == "httptools" else OneSendHttpProtocol,
        access_log=False,
        proxy_headers=False,  # as gateway/server.py
        log_level="warning",
    )


# -- the driver ---------------------------------------------------------------------------


def gateway_config(
    feature: str, port: int, router: dict[str, Any], state_dir: Path
) -> tuple[PlatformConfig, str]:
    """The config of the gateway for `feature` on `port` (the bench tenant's key; limits it
    never reaches from `quotas` on) with the router process's `router` config, and the
    registry address of its own router when it embeds one (`embedded`: new ports), else ""."""
    embedded = ""
    if feature == "embedded":
        router = {
            **router,
            "registry_bind": f"tcp://127.0.0.1:{free_port()}",
            "routing_bind": f"tcp://127.0.0.1:{free_port()}",
        }
        embedded = str(router["registry_bind"])
    limits = (
        {"requests_per_min": 10**9, "tokens_per_min": 10**12, "max_concurrent": 10**6}
        if FEATURES.index(feature) >= FEATURES.index("quotas")
        else {}
    )
    config = parse_config(
        {
            "state_dir": str(state_dir),
            "router": router,
            "gateway": {
                "port": port,
                "api_keys": [{"tenant": "bench", "sha256": hash_api_key(KEY)}],
                "tenants": [{"name": "bench", **limits}],
            },
        }
    )
    return config, embedded


def keep_registered(agents: list[RegistryAgent], stop: threading.Event) -> None:
    """Register the bench's stand-in replicas, then heartbeat them every second until `stop`
    (run on a thread)."""
    for agent in agents:
        agent.register()
    while not stop.is_set():
        for agent in agents:
            agent.heartbeat(p.ReplicaLoad())
            agent.process_replies(1.0)  # returns at the ack: not a sleep
        stop.wait(1.0)


def wrk_script(work: Path, bodies: list[bytes], *, stream: bool, fresh: bool) -> Path:
    """A wrk script cycling through `bodies`; `fresh`: each request's COUNTER a new number
    (one never sent before in this run), else "0" (the same bodies again)."""
    global _scripts
    _scripts += 1
    table = []
    for body in bodies:
        head, _, tail = body.decode().partition(COUNTER)
        assert "]==]" not in head + tail
        table.append(f"{{[==[{head}]==], [==[{tail}]==]}}")
    start = _scripts * 10_000_000
    number = "tostring(counter)" if fresh else "0"
    lines = [
        f"local bodies = {{{', '.join(table)}}}",
        f"local i, n, counter = 0, #bodies, {start}",
        'wrk.method = "POST"',
        'wrk.headers["Content-Type"] = "application/json"',
        f'wrk.headers["Authorization"] = "Bearer {KEY}"',
        *([f'wrk.headers["X-Request-Id"] = "{STREAM_MARK}"'] if stream else []),
        "request = function()",
        "  i = i % n + 1",
        "  counter = counter + 1",
        "  local b = bodies[i]",
        f"  return wrk.format(nil, nil, nil, b[1] .. {number} .. b[2])",
        "end",
    ]
    path = work / f"wrk-{_scripts}.lua"
    path.write_text("\n".join(lines) + "\n")
    return path


_scripts = 0


def run_wrk(url: str, script: Path, connections: int, seconds: int) -> dict[str, float]:
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency",
         "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # fmt: skip
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")

    def latency_ms(pct: str) -> float:
        found = re.search(rf"{pct}%\s+([\d.]+)(us|ms|s)", out)
        assert found, out
        return float(found.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[found.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert rps, out
    return {"p50_ms": latency_ms("50"), "p99_ms": latency_ms("99"), "rps": float(rps.group(1))}


def cpu_split(pid: int) -> tuple[float, float]:
    """A process's (user, system) CPU seconds so far, every thread's."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    return sum(cpu_split(pid))


def settle(pids: list[int], limit_s: float = 10.0) -> None:
    """Wait until these processes stop working off what a run left them (requests whose
    client has gone: a slow rung's backlog would otherwise run on the proxies' core during
    the next target's run): at most one clock tick of CPU each (~5% of a core) over 0.2 s."""
    deadline = time.monotonic() + limit_s
    tick = 1.5 / os.sysconf("SC_CLK_TCK")
    before = [cpu_seconds(pid) for pid in pids]
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = [cpu_seconds(pid) for pid in pids]
        if all(b - a < tick for a, b in zip(before, now, strict=True)):
            return
        before = now


def parse_strace_counts(text: str) -> dict[str, int]:
    """System call name -> calls, from `strace -c`'s summary table."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if (
            len(fields) in (5, 6)
            and fields[0].replace(".", "", 1).isdigit()
            and fields[-1] != "total"
            and fields[3].isdigit()
        ):
            calls[fields[-1]] = calls.get(fields[-1], 0) + int(fields[3])
    return calls


def trace_syscalls(pid: int, out: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """strace -c on `pid` and its threads until stop_tracing; attached once this returns."""
    tracer = subprocess.Popen(
        ["strace", "-c", "-f", "-p", str(pid), "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # attached to every thread (strace has no signal for it)
    return tracer, out


def stop_tracing(tracers: list[tuple[subprocess.Popen[bytes], Path]]) -> dict[str, int]:
    """Detach (SIGINT) and sum the calls of every traced process by name."""
    total: dict[str, int] = {}
    for tracer, out in tracers:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        for name, n in parse_strace_counts(out.read_text()).items():
            total[name] = total.get(name, 0) + n
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--upstream",
        choices=("nginx", "python"),
        default="nginx" if shutil.which("nginx") else "python",
        help="the fixed-answer upstream: nginx (default when installed) or a Python ASGI app",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated targets to run (default: all), e.g. relay,tracing",
    )
    parser.add_argument(
        "--bodies",
        choices=("chat", "small"),
        default="chat",
        help="chat: 1k-4k-token multi-turn chats (default); small: the old ~1.2 KB body",
    )
    parser.add_argument(
        "--cases",
        default="chat1,chat,stream1,repeat",
        help="of chat1, chat (at --concurrency), stream1, stream, repeat (the same bodies "
        "again, at --concurrency)",
    )
    parser.add_argument(
        "--rust-venv",
        default="",
        help="a virtual environment with sglang-router and/or vllm-router installed (pip): "
        "measured beside the gateway with their cache_aware policy",
    )
    parser.add_argument(
        "--router-core",
        default="0",
        help="the core the router is pinned to: 0 (default) is the proxies' own, so a "
        "gateway's figures are its and its router's on one core; 1 puts it beside wrk",
    )
    parser.add_argument(
        "--gateway-http",
        choices=("one-send", "httptools"),
        default="one-send",
        help="the gateways' HTTP protocol: one-send (the gateway's own, default: each answer "
        "in one send) or httptools (uvicorn's: head and body in two sends), for an A/B",
    )
    parser.add_argument(
        "--syscalls",
        action="store_true",
        help="count each target's system calls per request (strace -c on its process, every "
        "thread; the router process's too for the rungs that have one): strace slows what it "
        "traces, so this run's timings compare with nothing",
    )
    parser.add_argument(
        "--baseline",
        default="",
        help="a directory holding the hpcserve package of another commit "
        "(bench/baseline_package.sh REV DIR): every selected gateway but the plain relay also "
        "runs from it, as FEATURE@base, in the same rounds",
    )
    parser.add_argument(
        "--serve-gateway",
        nargs=5,
        metavar=("CONFIG", "FEATURE", "UPSTREAM", "MODEL_DIR", "HTTP"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.serve_gateway:
        serve_gateway(*args.serve_gateway)
        return
    if not shutil.which("wrk"):
        sys.exit("wrk is needed: apt-get install wrk")

    # A SIGTERM (e.g. from `timeout`) still stops the processes this started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    work = Path(tempfile.mkdtemp(prefix="hpcserve-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    upstream_port = free_port()
    py = sys.executable
    only = [t for t in args.only.split(",") if t]

    def spawn(
        argv: list[str], core: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["taskset", "-c", core, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        procs.append(proc)
        return proc

    # The bodies, as (chat, stream) lists; COUNTER is replaced per request by wrk.
    if args.bodies == "chat":
        conversations = chat_conversations()
        chat = [chat_body(m, stream=False) for m in conversations]
        streamed = [chat_body(m, stream=True) for m in conversations]
    else:
        chat, streamed = [CHAT_BODY], [CHAT_BODY[:-1] + b', "stream": true}']
    model_dir = ""
    if any(f.startswith("hints") or f in ("tracing", "embedded") for f in only or FEATURES):
        started = time.monotonic()
        model_dir = str(bench_model_dir(Path(tempfile.gettempdir())))
        from hpcserve.contracts.prompt_tokens import PromptTokenizer

        tok = PromptTokenizer.from_dir(model_dir)
        sizes = (
            sorted(len(tok.chat_tokens(m)) for m in conversations) if args.bodies == "chat" else []
        )
        print(
            f"tokenizer: vocab {tok.tokenizer.get_vocab_size()}, trained in "
            f"{time.monotonic() - started:.0f} s; prompts of {sizes[:1]}..{sizes[-1:]} tokens "
            f"(median {statistics.median(sizes) if sizes else 0:.0f}), bodies of "
            f"{min(map(len, chat))}-{max(map(len, chat))} bytes",
            file=sys.stderr,
            flush=True,
        )

    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    load_before = os.getloadavg()
    try:
        if args.upstream == "nginx":
            conf = nginx_config(work, upstream_port)
            spawn(["nginx", "-p", str(work), "-c", str(conf)], "1")
        else:
            spawn([py, "-m", "uvicorn", "bench.proxy_overhead:upstream_app", "--port",
                   str(upstream_port), "--loop", "uvloop", "--http", "httptools",
                   "--no-access-log", "--log-level", "warning"], "1")  # fmt: skip
        upstream = f"http://127.0.0.1:{upstream_port}"
        router_cfg = {
            "registry_bind": f"tcp://127.0.0.1:{free_port()}",
            "routing_bind": f"tcp://127.0.0.1:{free_port()}",
            "metrics_port": 0,
            "allow_plain_loopback": True,
        }
        keys = [{"tenant": "bench", "sha256": hash_api_key(KEY)}]
        state = {"state_dir": str(work / "state")}
        config = parse_config({**state, "router": router_cfg, "gateway": {"api_keys": keys}})
        (work / "router.toml").write_text(dump_config(config))
        router = spawn(
            [py, "-m", "hpcserve.cli", "router", "--config", str(work / "router.toml")],
            args.router_core,
        )
        targets: dict[str, tuple[str, int]] = {"direct": (upstream, 0)}
        embedded_registries: list[str] = []
        variants = [("", None)]
        if args.baseline:
            baseline = str(Path(args.baseline).resolve())
            variants.append(("@base", {**os.environ, BASELINE_ENV: baseline}))
        for feature in FEATURES:
            if only and feature not in only:
                continue
            for suffix, env in variants:
                if suffix and feature == "relay":
                    continue
                port = free_port()
                cfg, embedded_registry = gateway_config(feature, port, router_cfg, work / "state")
                if embedded_registry:
                    embedded_registries.append(embedded_registry)
                path = work / f"gateway-{feature}{suffix}.toml"
                path.write_text(dump_config(cfg))
                proc = spawn(
                    [py, str(ROOT / "bench" / "proxy_overhead.py"), "--serve-gateway", str(path),
                     feature, upstream, model_dir, args.gateway_http],
                    "0",
                    env,
                )  # fmt: skip
                targets[feature + suffix] = (f"http://127.0.0.1:{port}", proc.pid)
        rust_versions: dict[str, str] = {}
        if args.rust_venv:
            for name in RUST_ROUTERS:
                if only and name not in only:
                    continue
                venv = Path(args.rust_venv)
                version = subprocess.run(
                    [str(venv / "bin" / "pip"), "show", name], capture_output=True, text=True
                ).stdout
                if "Version:" not in version:
                    print(f"{name}: not installed in {venv}, left out", file=sys.stderr)
                    continue
                rust_versions[name] = version.split("Version:")[1].split()[0]
                port = free_port()
                launch = (
                    [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router",
                     "--prometheus-port", str(free_port())]
                    if name == "sglang-router"
                    else [str(venv / "bin" / "vllm-router")]
                )  # fmt: skip
                workers = [upstream, f"http://localhost:{upstream_port}"]
                proc = spawn([*launch, "--host", "127.0.0.1", "--port", str(port),
                              "--worker-urls", *workers, "--policy", "cache_aware",
                              "--log-level", "warn" if name == "sglang-router" else "warning"],
                             "0")  # fmt: skip
                targets[name] = (f"http://127.0.0.1:{port}", proc.pid)
        wait_http(upstream + "/")
        for feature, (url, _) in targets.items():
            # The plain relay has no /health: any answer (a 404) means it is up.
            wait_http(url + ("/v1/models" if feature == "relay" else "/health"), 60)

        # Two replicas (one upstream): prefix hints are skipped for a model with one.
        registries = [router_cfg["registry_bind"], *embedded_registries]
        agents = [
            RegistryAgent(registry, p.Register(f"bench-{n}", MODEL, upstream))
            for registry in registries
            for n in ("a", "b")
        ]
        stop = threading.Event()
        beat = threading.Thread(target=keep_registered, args=(agents, stop), daemon=True)
        beat.start()
        time.sleep(3)  # registered, and in every gateway's routing view (replica_view_s 2 s)

        many = args.concurrency
        kinds = {
            "chat1": ("chat", 1), "chat": ("chat", many), "stream1": ("stream", 1),
            "stream": ("stream", many), "repeat": ("repeat", many),
        }  # fmt: skip
        cases = [kinds[c] for c in args.cases.split(",") if c]
        warm = wrk_script(work, chat, stream=False, fresh=False)
        for base, _ in targets.values():  # warm-up: connections, caches, code paths
            run_wrk(base + "/v1/chat/completions", warm, 8, 2)
        for round_no in range(args.rounds):
            for case, conns in cases:
                for name, (base, pid) in targets.items():
                    key = f"{case} c={conns}"
                    script = wrk_script(
                        work,
                        streamed if case == "stream" else chat,
                        stream=case == "stream",
                        fresh=case != "repeat",
                    )
                    # A gateway with a router process (+ embedded's is in its own).
                    feature = name.removesuffix("@base")
                    gateway = feature in FEATURES and feature not in ("relay", "embedded")
                    cpu_before = cpu_split(pid) if pid else (0.0, 0.0)
                    router_before = cpu_split(router.pid) if gateway else (0.0, 0.0)
                    tracers = (
                        [trace_syscalls(x, work / f"strace-{x}.txt")
                         for x in ([pid, router.pid] if gateway else [pid])]
                        if args.syscalls and pid else []
                    )  # fmt: skip
                    r = run_wrk(base + "/v1/chat/completions", script, conns, args.seconds)
                    if tracers:
                        calls = stop_tracing(tracers)
                        served = r["rps"] * args.seconds
                        r["syscalls"] = sum(calls.values()) / served
                        r["syscalls_by_name"] = {k: v / served for k, v in calls.items()}
                    if pid and r["rps"] > 0:
                        requests = r["rps"] * args.seconds
                        user_now, system_now = cpu_split(pid)
                        user, system = user_now - cpu_before[0], system_now - cpu_before[1]
                        if gateway:
                            user_now, system_now = cpu_split(router.pid)
                            r_user = user_now - router_before[0]
                            r_system = system_now - router_before[1]
                            r["router_cpu_us"] = (r_user + r_system) / requests * 1e6
                            user, system = user + r_user, system + r_system
                        r["cpu_us"] = (user + system) / requests * 1e6
                        r["kernel_cpu_us"] = system / requests * 1e6
                    settle([pid, router.pid] if gateway else [pid] if pid else [])
                    results.setdefault(key, {}).setdefault(name, []).append(r)
                    print(
                        f"round {round_no + 1} {key:12s} {name:13s} p50 {r['p50_ms']:7.2f} ms"
                        f"  p99 {r['p99_ms']:7.2f} ms {r['rps']:8.0f} req/s"
                        + (f" {r['cpu_us']:6.0f} us CPU" if "cpu_us" in r else "")
                        + (f" (router {r['router_cpu_us']:.0f})" if "router_cpu_us" in r else ""),
                        file=sys.stderr,
                        flush=True,
                    )
        stop.set()
        beat.join(3)
        for agent in agents:
            agent.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)

    rows = []
    load_after = os.getloadavg()
    cpu_model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        "?",
    )  # fmt: skip
    print(
        f"\n{cpu_model}, {os.cpu_count()} cores; upstream: {args.upstream}; bodies: {args.bodies};"
        f" medians of {args.rounds} interleaved rounds of {args.seconds} s; load average "
        f"(1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in load_after)}"
        + (f"; {', '.join(f'{k} {v}' for k, v in rust_versions.items())}" if rust_versions else "")
    )
    print(
        "\n| case | target | p50 | added p50 | p99 | req/s (proxy on 1 core) "
        "| proxy CPU per request | of which the kernel | of which the router | CPU / relay's |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, by_target in results.items():
        med = {
            name: {
                m: statistics.median(r[m] for r in runs)
                for m in ("p50_ms", "p99_ms", "rps", "cpu_us", "kernel_cpu_us", "router_cpu_us")
                if all(m in r for r in runs)
            }
            for name, runs in by_target.items()
        }
        relay_cpu = med.get("relay", {}).get("cpu_us")
        for name, m in med.items():
            added = m["p50_ms"] - med["direct"]["p50_ms"]
            cpu = f"{m['cpu_us']:.0f} us" if "cpu_us" in m else "-"
            kernel = f"{m['kernel_cpu_us']:.0f} us" if "kernel_cpu_us" in m else "-"
            routed = f"{m['router_cpu_us']:.0f} us" if "router_cpu_us" in m else "-"
            ratio = f"{m['cpu_us'] / relay_cpu:.2f}x" if relay_cpu and "cpu_us" in m else "-"
            label = name if name in ("direct", "relay", *RUST_ROUTERS) else "+ " + name
            print(
                f"| {key} | {label} | "
                f"{m['p50_ms']:.2f} ms | {'-' if name == 'direct' else f'+{added:.2f} ms'} | "
                f"{m['p99_ms']:.2f} ms | {m['rps']:.0f} | {cpu} | {kernel} | {routed} | {ratio} |"
            )
            rows.append({"case": key, "target": name, **m})
    if args.syscalls:
        print(
            "\nSystem calls per request (strace -c; medians over the rounds; the five most "
            "frequent)\n\n| case | target | system calls per request | most frequent |"
            "\n|---|---|---|---|"
        )
        for key, by_target in results.items():
            for name, runs in by_target.items():
                if not all("syscalls" in r for r in runs):
                    continue
                names = {n for r in runs for n in r["syscalls_by_name"]}
                per = {
                    n: statistics.median(r["syscalls_by_name"].get(n, 0.0) for r in runs)
                    for n in names
                }
                top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
                label = name if name in ("relay", *RUST_ROUTERS) else "+ " + name
                print(
                    f"| {key} | {label} | {statistics.median(r['syscalls'] for r in runs):.1f} | "
                    + ", ".join(f"{n} {v:.2f}" for n, v in top)
                    + " |"
                )
    for row in rows:
        runs = results[row["case"]][row["target"]]
        if all("syscalls" in r for r in runs):
            row["syscalls"] = statistics.median(r["syscalls"] for r in runs)
    paired = paired_ratios(results)
    if paired:
        print(
            "\nPaired: each round's ratio to the same round's plain relay (and fastest Rust "
            "router), median over the rounds (the host's drift between rounds cancels)\n"
            "\n| case | target | CPU / relay's | added p50 / relay's | req/s / relay's "
            "| req/s / Rust router's |\n|---|---|---|---|---|---|"
        )
        for row in paired:
            print(
                f"| {row['case']} | {row['target']} | {row['cpu_vs_relay']:.2f}x | "
                f"{row['added_p50_vs_relay']:.2f}x | {row['rps_vs_relay']:.2f}x | "
                + (f"{row['rps_vs_rust']:.2f}x |" if "rps_vs_rust" in row else "- |")
            )
    meta = {
        "rounds": args.rounds,
        "seconds": args.seconds,
        "upstream": args.upstream,
        "bodies": args.bodies,
        "cpu": cpu_model,
        "rust_routers": rust_versions,
        "router_core": args.router_core,
        "load_before": load_before,
        "load_after": load_after,
        "syscalls_traced": args.syscalls,
    }
    name = "proxy_overhead_syscalls" if args.syscalls else "proxy_overhead"
    write_results(name, {"rows": rows, "paired": paired}, meta)


def paired_ratios(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[dict[str, Any]]:
    """Per case and target: the median over rounds of that round's ratio to the plain relay
    (CPU, added p50, req/s) and to the Rust router with the most req/s in that round."""
    out: list[dict[str, Any]] = []
    for key, by_target in results.items():
        relay, direct = by_target.get("relay"), by_target.get("direct")
        if not relay or not direct:
            continue
        rust = [by_target[name] for name in RUST_ROUTERS if name in by_target]
        for name, runs in by_target.items():
            if name in ("direct", "relay") or not all("cpu_us" in r for r in runs):
                continue
            rounds = list(zip(runs, relay, direct, strict=True))
            row: dict[str, Any] = {
                "case": key,
                "target": name,
                "cpu_vs_relay": statistics.median(r["cpu_us"] / q["cpu_us"] for r, q, _ in rounds),
                "added_p50_vs_relay": statistics.median(
                    (r["p50_ms"] - d["p50_ms"]) / (q["p50_ms"] - d["p50_ms"]) for r, q, d in rounds
                ),
                "rps_vs_relay": statistics.median(r["rps"] / q["rps"] for r, q, _ in rounds),
            }
            if rust and name not in RUST_ROUTERS:
                row["rps_vs_rust"] = statistics.median(
                    r["rps"] / max(x[i]["rps"] for x in rust) for i, r in enumerate(runs)
                )
            out.append(row)
    return out


if __name__ == "__main__":
    main()
