"""Command-line options of a simulated engine: vLLM's flags that matter, plus the sim's own.

vLLM flags honoured: --model (the directory whose tokenizer and config.json are used),
--served-model-name, --host, --port, --max-model-len, --max-num-seqs,
--max-num-batched-tokens, --block-size, --num-gpu-blocks-override,
--tensor-parallel-size, --kv-events-config (JSON, as vLLM takes it), --scheduling-policy
(fcfs, priority), --shutdown-timeout, --stream-interval and --kv-transfer-config (a prefill
or decode replica: any connector, modelled by sim/transfer.py). Other vLLM flags (--dtype
...) are accepted and ignored, so a pool's engine_args work for either engine.

The simulator's own: --sim-gpu (a GPU of the planner's catalog), --sim-model (a catalog
model or a config.json; default: the --model directory's config.json, else
llama-3.1-8b), --sim-weights-dtype / --sim-kv-dtype (bf16 default), --time-scale (wall
seconds per modelled second), and --prefill-ms-per-token / --decode-ms-per-token, which
replace the roofline by fixed timing. --sim-error-rate injects faults: that share of
completion requests is answered 500 (vLLM's error shape) before any token.
--sim-kv-link-gbps / --sim-kv-link-latency-ms: the link a decode replica loads a prompt's
KV cache over (default: the planner's InfiniBand preset, 320 Gb/s achievable, 0.1 ms).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hpcserve.planner.errors import PlanError
from hpcserve.planner.factors import Factors
from hpcserve.sim.engine import KVEventsConfig, SimConfig
from hpcserve.sim.scheduler import POLICIES, SchedulerLimits
from hpcserve.sim.timing import SimHardware, fixed_hardware, hardware
from hpcserve.sim.transfer import DEFAULT_LINK_GBPS, DEFAULT_LINK_LATENCY_MS
from hpcserve.sim.transfer import parse as parse_kv_transfer

DEFAULT_SIM_MODEL = "llama-3.1-8b"


class OptionsError(ValueError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    f = Factors()
    parser.add_argument("--model", default="", help="model directory (tokenizer, config.json)")
    parser.add_argument("--served-model-name", default="")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=f.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=f.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=f.kv_block_tokens)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-events-config", default="", help="vLLM's KV-events JSON")
    parser.add_argument("--kv-transfer-config", default="", help="vLLM's KV-transfer JSON")
    parser.add_argument(
        "--sim-kv-link-gbps",
        type=float,
        default=DEFAULT_LINK_GBPS,
        help="link a decode replica loads KV over, Gb/s",
    )
    parser.add_argument("--sim-kv-link-latency-ms", type=float, default=DEFAULT_LINK_LATENCY_MS)
    parser.add_argument("--scheduling-policy", default="fcfs", help="fcfs or priority")
    parser.add_argument("--sim-gpu", default="h100", help="GPU of the planner's catalog")
    parser.add_argument("--sim-model", default="", help="catalog model or config.json")
    parser.add_argument("--sim-weights-dtype", default="bf16", help="bf16, fp16, fp8, int4")
    parser.add_argument("--sim-kv-dtype", default="bf16", help="bf16, fp16, fp8")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="wall seconds per modelled second"
    )
    parser.add_argument("--prefill-ms-per-token", type=float, default=None)
    parser.add_argument("--decode-ms-per-token", type=float, default=None)
    parser.add_argument("--default-max-tokens", type=int, default=16)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="vLLM's: stream the first token, then every N tokens and the last",
    )
    parser.add_argument(
        "--request-trace", default="", help="append one JSON line per finished request here"
    )
    parser.add_argument(
        "--sim-error-rate",
        type=float,
        default=0.0,
        help="share of completion requests answered 500 (fault injection), 0 to 1",
    )


def kv_events_config(text: str) -> KVEventsConfig | None:
    """vLLM's --kv-events-config JSON; None when absent or disabled."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise OptionsError(f"--kv-events-config: not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise OptionsError(f"--kv-events-config: expected a JSON object, got {text!r}")
    if not raw.get("enable_kv_cache_events") or raw.get("publisher", "zmq") == "null":
        return None
    if raw.get("publisher", "zmq") != "zmq":
        raise OptionsError(f"--kv-events-config: publisher {raw['publisher']!r}; allowed: zmq")
    return KVEventsConfig(
        endpoint=str(raw.get("endpoint") or "tcp://*:5557"),
        replay_endpoint=raw.get("replay_endpoint") or None,
        topic=str(raw.get("topic") or ""),
    )


def sim_hardware(args: argparse.Namespace) -> SimHardware:
    model_dir = Path(args.model) if args.model else None
    model = args.sim_model
    if not model:
        has_config = model_dir is not None and (model_dir / "config.json").exists()
        model = str(model_dir) if has_config else DEFAULT_SIM_MODEL
    factors = Factors(
        kv_block_tokens=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    hw = hardware(
        args.sim_gpu,
        model,
        tp=args.tensor_parallel_size,
        factors=factors,
        num_blocks_override=args.num_gpu_blocks_override,
        weights_dtype=args.sim_weights_dtype,
        kv_dtype=args.sim_kv_dtype,
    )
    if args.prefill_ms_per_token is None and args.decode_ms_per_token is None:
        return hw
    return fixed_hardware(
        (args.prefill_ms_per_token or 0.0) / 1000,
        (args.decode_ms_per_token or 0.0) / 1000,
        kv_blocks=hw.kv_blocks,
        block_size=hw.block_size,
        kv_bytes_per_token=hw.kv_bytes_per_token,
    )


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The engine's config from parsed flags; OptionsError naming the flag when one is bad."""
    if not args.served_model_name:
        raise OptionsError("--served-model-name is required")
    if args.time_scale <= 0:
        raise OptionsError(f"--time-scale: must be > 0, got {args.time_scale}")
    if not 0 <= args.sim_error_rate <= 1:
        raise OptionsError(f"--sim-error-rate: must be from 0 to 1, got {args.sim_error_rate}")
    if args.scheduling_policy not in POLICIES:
        raise OptionsError(
            f"--scheduling-policy: {args.scheduling_policy!r}; allowed: {', '.join(POLICIES)}"
        )
    for flag in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "default_max_tokens",
        "stream_interval",
    ):
        if getattr(args, flag) < 1:
            name = "--" + flag.replace("_", "-")
            raise OptionsError(f"{name}: must be >= 1, got {getattr(args, flag)}")
    try:
        hw = sim_hardware(args)
    except PlanError as err:
        raise OptionsError(str(err)) from None
    try:
        kv_transfer = parse_kv_transfer(
            args.kv_transfer_config, args.sim_kv_link_gbps, args.sim_kv_link_latency_ms
        )
    except ValueError as err:
        raise OptionsError(str(err)) from None
    max_model_len = args.max_model_len or hw.max_context or 131072
    return SimConfig(
        served_model_name=args.served_model_name,
        hardware=hw,
        limits=SchedulerLimits(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=args.scheduling_policy,
        ),
        time_scale=args.time_scale,
        kv_events=kv_events_config(args.kv_events_config),
        default_max_tokens=args.default_max_tokens,
        request_trace=args.request_trace,
        error_rate=args.sim_error_rate,
        kv_transfer=kv_transfer,
        stream_interval=args.stream_interval,
    )
