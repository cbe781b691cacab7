"""The vLLM command line and environment for a replica, or for one node of it (pure).

A replica on one node is one vLLM API server. A replica across N nodes (vLLM's multi-node
launch with the multiprocessing backend) runs the same model arguments on every node with
`--nnodes N --node-rank R --master-addr HEAD --master-port PORT`: node rank 0 runs the API
server (and the workers of its node), every other rank runs `vllm serve --headless`
(workers only), which joins rank 0's torch.distributed group at HEAD:PORT.
"""

from __future__ import annotations

import getpass
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hpcserve.contracts.engine_args import engine_block_size
from hpcserve.contracts.engine_token import GUARD, TOKEN_ENV

# The file descriptor of the HTTP socket the engine made for vLLM (vllm_api.py).
HTTP_FD_VARIABLE = "HPCSERVE_HTTP_FD"


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
    # Multi-node replicas: this node's rank, and where rank 0 hosts torch.distributed.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    # KV-cache events for the router ("": off): vLLM binds its ZMQ publisher and replay
    # socket as ipc:// sockets in this directory, mode 0700, which only the service account
    # can enter; the engine agent relays them (kv_relay.py).
    kv_events_dir: str = ""
    # The router tells replicas' events apart by topic: the engine sets its replica id.
    kv_events_topic: str = "kv-events"
    # LoRA: on when max_loras > 0; lora_modules are (name, directory) loaded at start.
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    # The engine token guards every route (contracts/engine_token.py): vLLM gets the guard
    # as --middleware and the token in its environment (vllm_env), never in its argv.
    token_guard: bool = False
    # The engine's private directory (mode 0700, engine.py open_private_dir): vLLM's own
    # ipc:// sockets (VLLM_RPC_BASE_PATH) and temporary files (TMPDIR) go there ("": vLLM's
    # defaults, /tmp).
    runtime_dir: str = ""
    # Disaggregated prefill and decode over NIXL (contracts/engine_args.py): the host and
    # port of NIXL's side channel, where a decode engine fetches the prefill engine's KV
    # layout; one port per engine on a node (vLLM's default, 5600, is one for all). 0: none.
    nixl_host: str = ""
    nixl_port: int = 0
    # vLLM in a network namespace of its own (private_net.py): "off", "auto" (where the
    # kernel allows it, else one warning line) or "required" (refuse to start without it).
    # Not off, the engine binds the HTTP socket and passes it as HPCSERVE_HTTP_FD (vllm_api.py).
    private_network: str = "off"

    @property
    def headless(self) -> bool:
        return self.node_rank > 0

    @property
    def local_world_size(self) -> int:
        """Workers (GPUs) of this replica on this node."""
        return max(self.tensor_parallel * self.pipeline_parallel // self.nnodes, 1)


def _parallel_args(spec: EngineSpec) -> list[str]:
    argv: list[str] = []
    if spec.tensor_parallel > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel)]
    if spec.pipeline_parallel > 1:
        argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel)]
    return argv


def _multinode_args(spec: EngineSpec) -> list[str]:
    if spec.nnodes == 1:
        return []
    return [
        "--nnodes", str(spec.nnodes),
        "--node-rank", str(spec.node_rank),
        "--master-addr", spec.master_addr,
        "--master-port", str(spec.master_port),
    ]  # fmt: skip


def block_size(spec: EngineSpec) -> int:
    return engine_block_size(spec.engine, spec.extra_args)


def kv_events_endpoints(spec: EngineSpec) -> tuple[str, str]:
    """vLLM's KV-event publisher and replay socket: ipc:// in the engine's private directory."""
    return f"ipc://{spec.kv_events_dir}/events", f"ipc://{spec.kv_events_dir}/replay"


def kv_events_args(spec: EngineSpec) -> list[str]:
    """`--kv-events-config` (ZMQ publisher and replay socket); none when off or when the
    engine arguments already configure events."""
    if not spec.kv_events_dir or any(a.startswith("--kv-events-config") for a in spec.extra_args):
        return []
    events, replay = kv_events_endpoints(spec)
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM binds ipc:// endpoints; the engine agent subscribes (kv_relay.py). Never tcp:
        # the events carry every prompt's token ids, and any user of the node reaches a TCP
        # port, loopback included.
        "endpoint": events,
        "replay_endpoint": replay,
        "topic": spec.kv_events_topic,
    }
    # Prefix caching is on by default for generative models; forcing it with
    # --enable-prefix-caching breaks encoder-only pooling models (BERT), so it is not passed.
    return ["--kv-events-config", json.dumps(config)]


def lora_args(spec: EngineSpec) -> list[str]:
    if spec.max_loras <= 0:
        return []
    argv = [
        "--enable-lora",
        "--max-loras", str(spec.max_loras),
        "--max-lora-rank", str(spec.max_lora_rank),
    ]  # fmt: skip
    if spec.lora_modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in spec.lora_modules)]
    return argv


def vllm_argv(spec: EngineSpec) -> list[str]:
    if spec.engine == "sim" and spec.headless:
        # The simulated engine has no workers: a headless rank only waits to be stopped.
        return [spec.python, "-m", "hpcserve.sim.launch", "--headless"]
    if spec.headless:
        # `vllm serve --headless`: the API server module would ignore --headless (see
        # vllm_serve.py for why this is not `vllm serve` or `python -m vllm.entrypoints.cli.main`).
        return [
            spec.python, "-m", "hpcserve.engine_launch.vllm_serve",
            spec.model_path,
            "--served-model-name", spec.served_model_name,
            *_parallel_args(spec),
            *spec.extra_args,
            *_multinode_args(spec),
            "--headless",
        ]  # fmt: skip
    if spec.engine == "sim":
        return [
            spec.python, "-m", "hpcserve.sim.launch",
            # The simulator reads the tokenizer and config.json there, when it exists.
            "--model", spec.model_path,
            "--served-model-name", spec.served_model_name,
            "--host", spec.bind_host,
            "--port", str(spec.port),
            "--shutdown-timeout", str(spec.drain_s),
            *kv_events_args(spec),
            *spec.extra_args,
        ]  # fmt: skip
    # The module form: the CPU build's `vllm` console script fails (its dist is named vllm-cpu).
    # In a network namespace of its own, on the HTTP socket the engine made (vllm_api.py).
    private = spec.private_network != "off"
    argv = [
        *_private_net_prefix(spec),
        spec.python,
        "-m",
        "hpcserve.engine_launch.vllm_api" if private else "vllm.entrypoints.openai.api_server",
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
        *_parallel_args(spec),
        *kv_events_args(spec),
        *lora_args(spec),
        *(["--middleware", GUARD] if spec.token_guard else []),
        *spec.extra_args,
        *_multinode_args(spec),
    ]
    return argv


def _private_net_prefix(spec: EngineSpec) -> list[str]:
    if spec.private_network == "off":
        return []
    required = ["--required"] if spec.private_network == "required" else []
    return [spec.python, "-m", "hpcserve.engine_launch.private_net", *required, "--"]


def vllm_env(
    spec: EngineSpec,
    base: Mapping[str, str],
    cpu_count: int | None = None,
    *,
    engine_token: str = "",
) -> dict[str, str]:
    env = dict(base)
    if engine_token:
        # vLLM's own --api-key check and the guard read it here; the API server's
        # environment is readable by the service account alone.
        env[TOKEN_ENV] = engine_token
    # Weights come from disk; a hub lookup would hang on an offline cluster.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if spec.runtime_dir:
        # vLLM's frontend <-> engine core <-> worker ZMQ sockets are ipc:// paths under
        # VLLM_RPC_BASE_PATH (default /tmp, their mode then the umask's: others may connect
        # where it is permissive); its temporary files (torch.distributed's file store,
        # /tmp/vllm_dist_*, 0644 and left behind) follow TMPDIR. Both into the engine's
        # private directory, which only the service account may enter.
        env["VLLM_RPC_BASE_PATH"] = spec.runtime_dir
        env["TMPDIR"] = spec.runtime_dir
        # torch's compiled-kernel cache follows TMPDIR too: keep it where torch keeps it by
        # default (beside the private directory, torchinductor_<user>), so a start does not
        # compile again what the last one did. A site's own setting wins.
        env.setdefault(
            "TORCHINDUCTOR_CACHE_DIR",
            os.path.join(os.path.dirname(spec.runtime_dir), f"torchinductor_{_user()}"),
        )
    if spec.nixl_port:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.nixl_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.nixl_port)
    if spec.private_network != "off":
        # The namespace has no interface but loopback: torch.distributed's gloo, NCCL's
        # bootstrap and vLLM's own address lookup use it (a site's setting naming the node's
        # interfaces would name one that is not there).
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["NCCL_SOCKET_IFNAME"] = "lo"
        env["VLLM_HOST_IP"] = "127.0.0.1"
    if spec.max_loras > 0:
        # The router loads and unloads adapters at run time (router/adapters.py).
        env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    if spec.engine == "vllm-cpu":
        if _has_flag(spec.extra_args, "--kv-cache-memory-bytes"):
            # The CPU build lets VLLM_CPU_KVCACHE_SPACE win over the flag: the pool's own
            # argument must, so the variable goes (one inherited from the job too).
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if spec.tensor_parallel * spec.pipeline_parallel > 1:
            # Without an explicit binding the CPU build asserts about NUMA nodes. One core per
            # worker of this node; each node rank starts at its own core, so ranks that share
            # a machine (the local two-node cluster) do not pin their workers to one core.
            cores = cpu_count or os.cpu_count() or 1
            first = spec.node_rank * spec.local_world_size
            env.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND",
                "|".join(str((first + i) % cores) for i in range(spec.local_world_size)),
            )
    return env


def _user() -> str:
    """The account's name as torch writes it in its default cache directory's name."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", name)


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


# What the engine's log shows of vLLM's environment: the variables that steer it.
_LOGGED_ENV_PREFIXES = (
    "VLLM_", "HF_", "OMP_", "CUDA_", "NCCL_", "GLOO_", "TRANSFORMERS_", "PYTHONHASHSEED",
    HTTP_FD_VARIABLE,
)  # fmt: skip
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")


def describe_env(env: Mapping[str, str]) -> str:
    """The variables that steer vLLM, as `NAME=value` in name order, secrets masked."""
    shown = []
    for name in sorted(env):
        if not name.startswith(_LOGGED_ENV_PREFIXES):
            continue
        value = "***" if any(word in name.upper() for word in _SECRET_WORDS) else env[name]
        shown.append(f"{name}={value}")
    return " ".join(shown)
