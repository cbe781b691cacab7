"""Choosing the tensor-parallel size: the smallest that fits weights plus a useful KV budget."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from hpcserve.planner.errors import PlanError
from hpcserve.planner.factors import Factors
from hpcserve.planner.replica import (
    GIB,
    Replica,
    kv_bytes_per_token,
    memory_fit,
    tp_options,
    weights_bytes,
)


class TPChoice(msgspec.Struct, frozen=True):
    tp: int
    reason: str
    meets_latency: bool = True


def choose_tp(
    template: Replica,
    context: int,
    factors: Factors,
    meets_latency: Callable[[Replica], bool] | None = None,
) -> TPChoice:
    """The smallest TP within one node whose KV budget holds ``min_kv_seqs`` full sequences.

    Candidates are powers of two up to ``gpus_per_node`` that split the heads evenly. With
    ``meets_latency``, the smallest fitting TP that also passes it is taken (more GPUs per
    replica make each step faster); if none does, the smallest fitting one, flagged. Raises
    PlanError stating the memory needed against the memory a whole node gives when no TP fits.
    """
    fitting = []
    for tp in tp_options(template.model, template.gpu.gpus_per_node):
        seqs = memory_fit(msgspec.structs.replace(template, tp=tp), factors).max_seqs(context)
        if seqs >= factors.min_kv_seqs:
            fitting.append(tp)
    if not fitting:
        raise PlanError(_no_fit_message(template, context, factors))
    rule = (
        f"smallest TP (power of two splitting the heads) whose memory holds the weights "
        f"+ KV for {factors.min_kv_seqs} sequences of {context:,} tokens"
    )
    if meets_latency is None:
        return TPChoice(fitting[0], rule)
    for tp in fitting:
        if meets_latency(msgspec.structs.replace(template, tp=tp)):
            return TPChoice(tp, rule + ", and meets the latency target at batch 1")
    return TPChoice(fitting[0], rule + "; no TP within a node meets the latency target", False)


def _no_fit_message(template: Replica, context: int, factors: Factors) -> str:
    model, gpu = template.model, template.gpu
    weights = weights_bytes(model, template.weights_dtype) / GIB
    kv = factors.min_kv_seqs * context * kv_bytes_per_token(model, template.kv_dtype) / GIB
    nodes_tp = max(tp_options(model, gpu.gpus_per_node))
    usable = gpu.memory_gib * factors.gpu_memory_utilization - factors.runtime_overhead_gib
    return (
        f"--model: {model.name} does not fit on up to {gpu.gpus_per_node} x {gpu.name} "
        f"(--gpus-per-node) at any TP: it needs {weights:,.1f} GiB of {template.weights_dtype} "
        f"weights + {kv:,.1f} GiB of {template.kv_dtype} KV for {factors.min_kv_seqs} sequences "
        f"of {context:,} tokens = {weights + kv:,.1f} GiB; TP={nodes_tp} has {nodes_tp} x "
        f"{usable:,.1f} GiB = {nodes_tp * usable:,.1f} GiB usable "
        f"({gpu.memory_gib:g} GiB x {factors.gpu_memory_utilization:g} - "
        f"{factors.runtime_overhead_gib:g} GiB runtime). Try --weights-dtype fp8/int4, "
        "--kv-dtype fp8, a shorter --context, a larger GPU or an explicit --tp across nodes"
    )
