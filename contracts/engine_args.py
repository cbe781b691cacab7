"""Engine arguments that the pool manager, the gateway and the engine agree on, read off a
pool's engine arguments without starting anything."""

from __future__ import annotations

from collections.abc import Sequence

# vLLM's block size when --block-size is not given: 128 on the CPU build, 16 on GPUs
# (and in the simulator, which models a GPU).
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


# The tool-call parsers vLLM 0.32.0 ships (vllm/tool_parsers/__init__.py; a unit test compares
# this with the installed vLLM). A pool's tool_call_parser must be one of them.
TOOL_CALL_PARSERS = frozenset({
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31",
    "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4",
    "gigachat3", "glm45", "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf",
    "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2",
    "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai",
    "phi4_mini_json", "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json",
    "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
})  # fmt: skip


def tool_call_args(parser: str) -> list[str]:
    """vLLM's tool calling for a pool's tool_call_parser: `tool_choice` auto, required, a
    named function and none then work (required and named are guided by the tool schemas);
    none when the parser is ""."""
    if not parser:
        return []
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser]
