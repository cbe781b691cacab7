"""The vLLM command line and environment for a replica (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineSpec:
    model_path: str
    served_model_name: str
    engine: str  # "vllm", "vllm-cpu", or "sim" (the simulated engine, for control-plane tests)
    python: str
    bind_host: str
    port: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    drain_s: int = 30
    extra_args: Sequence[str] = field(default_factory=tuple)


def vllm_argv(spec: EngineSpec) -> list[str]:
    if spec.engine == "sim":
        return [
            spec.python, "-m", "hpcserve.engine_launch.sim_engine",
            "--served-model-name", spec.served_model_name,
            "--host", spec.bind_host,
            "--port", str(spec.port),
            "--shutdown-timeout", str(spec.drain_s),
            *spec.extra_args,
        ]  # fmt: skip
    # The module form: the CPU build's `vllm` console script fails (its dist is named vllm-cpu).
    argv = [
        spec.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model_path,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.bind_host,
        "--port",
        str(spec.port),
        # With a timeout, SIGTERM lets in-flight requests finish; with 0 it aborts them.
        "--shutdown-timeout",
        str(spec.drain_s),
        "--disable-uvicorn-access-log",
    ]
    if spec.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel)]
    if spec.pipeline_parallel > 1:
        argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel)]
    argv += list(spec.extra_args)
    return argv


def vllm_env(spec: EngineSpec, base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    # Weights come from disk; a hub lookup would hang on an offline cluster.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if spec.engine == "vllm-cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if spec.tensor_parallel * spec.pipeline_parallel > 1:
            # Without an explicit binding the CPU build asserts about NUMA nodes.
            env.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND",
                "|".join(str(i) for i in range(spec.tensor_parallel * spec.pipeline_parallel)),
            )
    return env
