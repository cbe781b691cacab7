"""Engine arguments that the pool manager, the gateway and the engine agree on, read off a
pool's engine arguments without starting anything."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

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


# Disaggregated prefill and decode (pools[].role "prefill" / "decode", docs/disaggregation.md):
# the KV-transfer connector each engine kind runs. NIXL moves KV between GPUs (RDMA, NVLink)
# and needs the nixl package; the CPU build uses vLLM's ExampleConnector, which stores each
# prompt's KV cache (full blocks) as files in a shared directory, keyed by the prompt's tokens.
# The simulated engine models a transfer (sim/transfer.py) under its own name.
NIXL_CONNECTOR = "NixlConnector"
STORAGE_CONNECTOR = "ExampleConnector"
SIM_CONNECTOR = "SimConnector"
PD_ROLES = ("prefill", "decode")
KV_TRANSFER_FLAG = "--kv-transfer-config"
# The storage connector's directory is swept by the engines' janitors
# (engine_launch/kv_janitor.py): entries older than this go (pools[].kv_transfer_ttl_s)...
KV_TRANSFER_TTL_S = 300.0
# ... and the oldest beyond this many MB (pools[].kv_transfer_max_mb).
KV_TRANSFER_MAX_MB = 4096


def kv_connector(engine: str) -> str:
    """The connector a prefill or decode replica of `engine` runs ("": none known)."""
    return {"vllm": NIXL_CONNECTOR, "vllm-cpu": STORAGE_CONNECTOR, "sim": SIM_CONNECTOR}.get(
        engine, ""
    )


def kv_transfer_args(
    role: str, engine: str, engine_args: Sequence[str], storage_dir: str = ""
) -> list[str]:
    """`--kv-transfer-config` for a prefill or decode pool's engine; none for other roles,
    or when the pool's engine_args configure the connector themselves.

    A prefill engine is kv_producer, a decode engine kv_consumer (vLLM 0.32 deprecates
    kv_both for NIXL); the storage connector keeps its files in `storage_dir`."""
    connector = kv_connector(engine)
    if role not in PD_ROLES or not connector:
        return []
    if any(a == KV_TRANSFER_FLAG or a.startswith(KV_TRANSFER_FLAG + "=") for a in engine_args):
        return []
    config: dict[str, object] = {
        "kv_connector": connector,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
    }
    if connector == STORAGE_CONNECTOR:
        config["kv_connector_extra_config"] = {"shared_storage_path": storage_dir}
    return [KV_TRANSFER_FLAG, json.dumps(config, separators=(",", ":"))]


def _kv_transfer_config(engine_args: Sequence[str]) -> dict[str, Any]:
    """The `--kv-transfer-config` an engine's arguments give ({} for none, or unreadable)."""
    args = list(engine_args)
    for i, arg in enumerate(args):
        value = ""
        if arg == KV_TRANSFER_FLAG and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(KV_TRANSFER_FLAG + "="):
            value = arg.partition("=")[2]
        if value:
            try:
                config = json.loads(value)
            except ValueError:
                return {}
            return config if isinstance(config, dict) else {}
    return {}


def kv_connector_of(engine_args: Sequence[str]) -> str:
    """The connector an engine's arguments configure ("" for none, or unreadable)."""
    connector = _kv_transfer_config(engine_args).get("kv_connector")
    return connector if isinstance(connector, str) else ""


def kv_storage_dir_of(engine_args: Sequence[str]) -> str:
    """Where the storage connector keeps prompts' KV blocks ("" for none): tenants' data, so
    the engine makes it a directory only the service account may enter."""
    extra = _kv_transfer_config(engine_args).get("kv_connector_extra_config")
    path = extra.get("shared_storage_path") if isinstance(extra, dict) else None
    return path if isinstance(path, str) else ""
