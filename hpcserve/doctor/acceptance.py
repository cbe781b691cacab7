"""The GPU acceptance run (`hpcserve doctor --gpu`, scripts/gpu-acceptance.sh): on one GPU
machine, unattended, no internet, it proves the GPU path end to end and prints what it
verified, a line per step:

1. nvml: the real NVML loads, sees the GPUs, and the health checks find nothing to act on.
2. model: a tiny random-weight chat model is made and registered (digest manifest).
3. stack: router, gateway, pool manager (local launcher: engines as local processes, the
   same job script Slurm runs) and batch runner start; the TP=1 pool's engine stages the
   model into the node cache (digests verified) and registers with the router.
4. per pool (TP=1; TP=2 where there are 2+ GPUs): a chat completion and a streamed one
   through gateway -> router -> vLLM; KV-cache events reach the router (its
   hpcserve_router_kv_blocks_stored counter grows); a drain: streams in flight while the
   pool is scaled to 0 all finish (finish_reason "length"), and the replica leaves routing.

`--cpu` runs the same steps on vLLM's CPU build (TP=1 only, NVML skipped: no GPU), which is
what the test suite runs here (tests/integration/test_gpu_acceptance_cpu.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcserve.config import (
    ApiKey,
    BatchConfig,
    EngineHostConfig,
    GatewayConfig,
    HealthConfig,
    PlatformConfig,
    PoolConfig,
    PoolMgrConfig,
    RouterConfig,
    dump_config,
    hash_api_key,
    load_config,
)
from hpcserve.doctor.types import CheckResult, Status

API_KEY = "sk-hpcserve-acceptance"
HOST = "acceptance"


@dataclass
class Stream:
    """One streamed completion, read on a thread: its tokens and how it ended."""

    chunks: int = 0
    finish_reason: str = ""
    error: str = ""
    first_at: float = 0.0
    ended_at: float = 0.0
    started: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Phase:
    pool: str
    model: str
    tp: int


class Acceptance:
    def __init__(
        self, work: Path, *, cpu: bool, timeout_s: float, say: Callable[[str], None]
    ) -> None:
        self.work = work.resolve()
        self.cpu = cpu
        self.deadline = time.monotonic() + timeout_s
        self.say = say
        self.results: list[CheckResult] = []
        self.config: PlatformConfig | None = None
        self.foreign_gpu_pids: set[int] = set()

    # -- results
    def record(self, step: str, status: Status, detail: str, fix: str = "") -> bool:
        from hpcserve.doctor.report import format_line

        result = CheckResult(step, status, detail, fix, host=HOST)
        self.results.append(result)
        self.say(format_line(result))
        return status != "fail"

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), 1.0)

    # -- the run
    def run(self) -> list[CheckResult]:
        gpus = self.check_nvml()
        if gpus is None:
            return self.results
        phases = [Phase("accept-tp1", "tiny-tp1", 1)]
        if gpus >= 2:
            phases.append(Phase("accept-tp2", "tiny-tp2", 2))
        else:
            why = "--cpu runs TP=1 only" if self.cpu else f"{gpus} GPU on this machine"
            self.record("tp2", "skip", f"skipped: TP=2 needs 2 GPUs ({why})")
        config_path = self.write_config(phases)
        from hpcserve.stack import Stack

        stack = Stack(self.work / "state", config_path=str(config_path))
        try:
            if stack.up(launcher="local", timeout_s=self.left()) != 0:
                self.record(
                    "stack",
                    "fail",
                    "the stack did not serve the TP=1 pool (log tails above)",
                    f"read {self.work / 'state' / 'logs'} and {self.work / 'state' / 'jobs'}",
                )
                return self.results
            self.record(
                "stack",
                "ok",
                "router, gateway, pool manager and batch runner up; "
                "the TP=1 engine staged the model (digests verified) and registered",
            )
            for i, phase in enumerate(phases):
                if i > 0 and not self.start_pool(phase):
                    break
                if not self.serve(phase):
                    break
                self.kv_events(phase)
                self.drain(phase)
        finally:
            stack.down()
        return self.results

    def our_gpu_processes(self) -> list[int]:
        """GPU processes that were not there before the run (the site's own are left out)."""
        return [pid for pid in gpu_processes() if pid not in self.foreign_gpu_pids]

    def check_nvml(self) -> int | None:
        """GPUs NVML sees (None: the run cannot go on)."""
        if self.cpu:
            self.record("nvml", "skip", "skipped: no GPU (--cpu: vLLM's CPU build)")
            return 1
        from hpcserve.doctor.gather import gather_nvml

        facts = gather_nvml("", HealthConfig())
        if not facts.loaded or not facts.gpus:
            self.record(
                "nvml",
                "fail",
                f"NVML: {facts.error or 'no GPU'}",
                "run on a GPU node with the NVIDIA driver loaded (`nvidia-smi` works)",
            )
            return None
        if facts.findings:
            self.record(
                "nvml",
                "fail",
                "GPU health: " + "; ".join(facts.findings),
                "`hpcserve health check -v` shows NVML's readings",
            )
            return None
        self.foreign_gpu_pids = set(gpu_processes())
        self.record(
            "nvml",
            "ok",
            f"NVML health checks clean on {len(facts.gpus)} GPU(s): " + "; ".join(facts.gpus),
        )
        return len(facts.gpus)

    def write_config(self, phases: list[Phase]) -> Path:
        from hpcserve.modelcache.manifest import build_manifest
        from hpcserve.modelcache.registry import NotFoundError, Registry
        from hpcserve.ports import free_ports
        from hpcserve.tinymodels import make_tiny_model

        state = self.work / "state"
        state.mkdir(parents=True, exist_ok=True)
        source = self.work / "models" / "tiny-chat"
        if not (source / "config.json").exists():
            make_tiny_model("chat", source)
        with Registry(state / "registry.sqlite3") as registry:
            try:
                registry.version("tiny@1")
            except NotFoundError:
                registry.add_version("tiny", str(source), build_manifest(source))
        self.record("model", "ok", f"tiny chat model {source} registered as tiny@1 (digests)")
        ports = free_ports(6)
        pools = [
            self.pool_config(phase, replicas=1 if i == 0 else 0) for i, phase in enumerate(phases)
        ]
        config = PlatformConfig(
            state_dir=str(state),
            router=RouterConfig(
                registry_bind=f"tcp://127.0.0.1:{ports[0]}",
                routing_bind=f"tcp://127.0.0.1:{ports[1]}",
                metrics_port=ports[2],
                heartbeat_s=1.0,
            ),
            gateway=GatewayConfig(
                port=ports[3], api_keys=[ApiKey(tenant="acceptance", sha256=hash_api_key(API_KEY))]
            ),
            poolmgr=PoolMgrConfig(
                launcher="local", poll_s=0.5, metrics_port=ports[4], handover_lead_s=0
            ),
            batch=BatchConfig(metrics_port=ports[5]),
            engine=EngineHostConfig(
                bind_host="127.0.0.1",
                advertise_host="127.0.0.1",
                cache_dir=str(self.work / "nodecache"),
            ),
            pools=pools,
        )
        path = state / "hpcserve.toml"
        path.write_text(dump_config(config))
        (state / "demo-api-key").write_text(API_KEY + "\n")
        self.config = load_config(path)  # validated as a site's would be
        return path

    def pool_config(self, phase: Phase, replicas: int) -> PoolConfig:
        if self.cpu:
            engine_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096"]
            env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
        else:
            engine_args = [
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--max-model-len",
                "4096",
                "--gpu-memory-utilization",
                "0.3",
            ]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(phase.tp))}
        return PoolConfig(
            name=phase.pool,
            model_ref="tiny@1",
            served_model_name=phase.model,
            replicas=replicas,
            engine="vllm-cpu" if self.cpu else "vllm",
            gpus_per_replica=phase.tp,
            tensor_parallel=phase.tp,
            engine_args=engine_args,
            env=env,
        )

    # -- per pool
    @property
    def cfg(self) -> PlatformConfig:
        assert self.config is not None
        return self.config

    def replicas(self, model: str) -> list[str]:
        from hpcserve.contracts.router_client import RouterQueryError, list_replicas

        try:
            found = list_replicas(
                self.cfg.router.gateways_dial(), 2.0, curve_dir=self.cfg.router.curve_dir
            )
        except RouterQueryError:
            return []
        return [r.replica_id for r in found if r.model == model]

    def start_pool(self, phase: Phase) -> bool:
        from hpcserve.poolmgr.state_files import write_override

        write_override(Path(self.cfg.state_dir), phase.pool, 1)
        if not self.wait(lambda: self.replicas(phase.model), self.left()):
            return self.record(
                f"tp{phase.tp}",
                "fail",
                f"no replica of {phase.pool} registered",
                f"read {Path(self.cfg.state_dir) / 'jobs'}",
            )
        self.record(f"tp{phase.tp}", "ok", f"the TP={phase.tp} engine registered")
        return True

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.cfg.gateway.port}{path}"

    def post(self, body: dict[str, object], timeout_s: float = 120) -> dict[str, object]:
        request = urllib.request.Request(
            self.url("/v1/chat/completions"),
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            answer: dict[str, object] = json.loads(resp.read())
            return answer

    def serve(self, phase: Phase) -> bool:
        step = f"serve tp{phase.tp}"
        body = {
            "model": phase.model,
            "max_tokens": 16,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hello from the acceptance run"}],
        }
        try:
            answer = self.post(body)
        except (urllib.error.URLError, OSError, ValueError) as err:
            return self.record(
                step,
                "fail",
                f"chat completion through the gateway: {err}",
                "read the gateway's and the engine's logs",
            )
        usage = answer.get("usage") or {}
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if tokens != 16:
            return self.record(step, "fail", f"unexpected answer: {answer}", "read the logs")
        stream = Stream()
        self.stream(phase.model, 32, stream)
        if stream.error or stream.finish_reason != "length":
            return self.record(
                step,
                "fail",
                f"streamed completion: {stream.error or stream}",
                "read the gateway's and the engine's logs",
            )
        return self.record(
            step,
            "ok",
            f"gateway -> router -> vLLM (TP={phase.tp}): a chat "
            f"completion (16 tokens) and a stream ({stream.chunks} chunks)",
        )

    def stream(self, model: str, max_tokens: int, out: Stream) -> None:
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "messages": [{"role": "user", "content": "Count slowly."}],
        }
        request = urllib.request.Request(
            self.url("/v1/chat/completions"),
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            out.chunks += 1
                            if not out.first_at:
                                out.first_at = time.monotonic()
                                out.started.set()
                        if choice.get("finish_reason"):
                            out.finish_reason = choice["finish_reason"]
        except (urllib.error.URLError, OSError, ValueError) as err:
            out.error = str(err)
        finally:
            out.ended_at = time.monotonic()
            out.started.set()

    def kv_blocks(self) -> float:
        url = f"http://127.0.0.1:{self.cfg.router.metrics_port}/metrics"
        try:  # the router's /metrics asks for the metrics token (contracts/metrics_http.py)
            token = Path(self.cfg.metrics_token_path()).read_text().strip()
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=5) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return -1.0
        for line in text.splitlines():
            if line.startswith("hpcserve_router_kv_blocks_stored_total "):
                return float(line.split()[1])
        return -1.0

    def kv_events(self, phase: Phase) -> bool:
        step = f"kv events tp{phase.tp}"
        before = self.kv_blocks()
        # Long enough for several full KV blocks (16 tokens on GPU, 128 on CPU).
        words = " ".join(f"w{i} acceptance" for i in range(150))
        body = {
            "model": phase.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": words}],
        }
        try:
            self.post(body)
        except (urllib.error.URLError, OSError, ValueError) as err:
            return self.record(step, "fail", f"the long prompt failed: {err}", "read the logs")
        grew = self.wait(lambda: self.kv_blocks() > max(before, 0), 60)
        if not grew:
            return self.record(
                step,
                "fail",
                f"the router's kv_blocks_stored stayed at {before:g}",
                "the engine's KV-event relay does not reach the router: read the job output",
            )
        return self.record(
            step,
            "ok",
            f"vLLM's KV events reached the router: blocks stored "
            f"{max(before, 0):g} -> {self.kv_blocks():g}",
        )

    def drain(self, phase: Phase) -> bool:
        from hpcserve.poolmgr.state_files import write_override

        step = f"drain tp{phase.tp}"
        count, tokens = 4, (1500 if self.cpu else 3000)
        streams = [Stream() for _ in range(count)]
        threads = [
            threading.Thread(target=self.stream, args=(phase.model, tokens, s), daemon=True)
            for s in streams
        ]
        for t in threads:
            t.start()
        for s in streams:
            s.started.wait(60)
        write_override(Path(self.cfg.state_dir), phase.pool, 0)
        drained_at = time.monotonic()
        left = self.wait(lambda: not self.replicas(phase.model), min(self.left(), 180))
        left_at = time.monotonic()
        for t in threads:
            t.join(min(self.left(), 300))
        broken = [s for s in streams if s.error or s.finish_reason != "length"]
        if not left:
            return self.record(
                step,
                "fail",
                "the replica never left routing after scale to 0",
                "read the pool manager's log",
            )
        if broken:
            shown = "; ".join(s.error or f"finish_reason {s.finish_reason!r}" for s in broken)
            return self.record(
                step,
                "fail",
                f"{len(broken)} of {count} in-flight streams broke during the drain: {shown}",
                "the drain must let in-flight requests finish: read the engine's job output",
            )
        in_flight = sum(1 for s in streams if s.ended_at > drained_at)
        detail = (
            f"scaled to 0 with {count} streams of {tokens} tokens running: all finished "
            f"(finish_reason length), {in_flight} after the drain began; the replica left "
            f"routing {left_at - drained_at:.1f} s after it"
        )
        if not self.cpu:
            # The next pool shares GPU 0: vLLM's start-up memory profiling fails if another
            # process frees GPU memory meanwhile, so the drained engine must be gone first.
            if not self.wait(lambda: self.our_gpu_processes() == [], min(self.left(), 120)):
                return self.record(
                    step,
                    "fail",
                    detail + f"; but GPU processes remain: {self.our_gpu_processes()}",
                    "the drained engine did not exit: read its job output in state/jobs",
                )
            detail += "; the engine exited and freed the GPUs"
        if not in_flight:
            return self.record(
                step,
                "warn",
                detail + "; none was still running, so the "
                "drain of in-flight requests was not exercised",
                "a faster engine than expected: raise the streams' tokens",
            )
        return self.record(step, "ok", detail)

    def wait(self, probe: Callable[[], object], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with contextlib.suppress(Exception):
                if probe():
                    return True
            time.sleep(0.5)
        return False


def gpu_processes() -> list[int]:
    """Pids of the processes NVML sees computing on any GPU (a lent machine runs nothing
    else)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        pids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids += [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        return pids
    finally:
        pynvml.nvmlShutdown()


def run_acceptance(work: Path, *, cpu: bool, timeout_s: float) -> list[CheckResult]:
    def say(line: str) -> None:
        print(f"[acceptance] {line}", flush=True)

    return Acceptance(work, cpu=cpu, timeout_s=timeout_s, say=say).run()
