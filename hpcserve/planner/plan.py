"""``plan(request)``: resolve the model, GPU and TP, then build each section of the report.

Steps: resolve model and GPU (catalog or config.json); load a calibration if given; pick
TP (the request's, else the calibration's, else the smallest that fits weights plus
``min_kv_seqs`` sequences and, with a latency target, meets it at batch 1); check the
replica fits; then the memory, performance, fleet, GPU budget, batch job and economics
sections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import msgspec

from hpcserve.planner import pd_section, sections
from hpcserve.planner.calibrate import (
    CalibratedModel,
    Calibration,
    check_matches,
    load_calibration,
)
from hpcserve.planner.dtypes import KVDtype, WeightsDtype
from hpcserve.planner.errors import PlanError
from hpcserve.planner.factors import Factors
from hpcserve.planner.gpus import get_gpu
from hpcserve.planner.models import ModelSpec, resolve_model
from hpcserve.planner.replica import GIB, Replica, check_tp, memory_fit, tp_options
from hpcserve.planner.report import PlanReport
from hpcserve.planner.request import PlanRequest
from hpcserve.planner.setup import Setup
from hpcserve.planner.tp import choose_tp


def plan(request: PlanRequest, factors: Factors | None = None) -> PlanReport:
    """Answer a planning question; raises PlanError naming the flag on bad input."""
    setup = resolve(request, factors or Factors())
    fleet = sections.fleet_report(setup)
    at_batch = request.batch or (fleet.batch_per_replica if fleet else None)
    performance = sections.performance_report(setup, at_batch)
    return PlanReport(
        request=request,
        model=sections.model_info(setup.replica.model),
        gpu=setup.replica.gpu,
        factors=setup.factors,
        memory=sections.memory_report(setup),
        performance=performance,
        economics=sections.economics_report(setup, fleet, performance),
        fleet=fleet,
        budget=sections.budget_report(setup),
        batch_job=sections.batch_job_report(setup),
        warnings=setup.warnings,
        pd=pd_section.pd_report(setup, fleet),
    )


def resolve(request: PlanRequest, factors: Factors) -> Setup:
    """The replica to plan for, its memory and its step model, with the warnings so far."""
    template = _template(request)
    calibration = load_calibration(request.calibrate) if request.calibrate else None
    tp, reason, warnings = _pick_tp(request, factors, template, calibration)
    setup = Setup.roofline(request, factors, msgspec.structs.replace(template, tp=tp))
    setup.tp_reason, setup.warnings = reason, warnings
    if calibration is not None:
        check_matches(calibration, setup.replica, path=str(request.calibrate))
        setup.model = CalibratedModel(calibration, label=str(request.calibrate))
    _check_fit(setup)
    setup.warnings.extend(_replica_warnings(setup))
    return setup


def _template(request: PlanRequest) -> Replica:
    model = request.model
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    gpu = get_gpu(request.gpu)
    if request.gpus_per_node is not None:
        gpu = msgspec.structs.replace(gpu, gpus_per_node=request.gpus_per_node)
    weights, kv = cast(WeightsDtype, request.weights_dtype), cast(KVDtype, request.kv_dtype)
    return Replica(spec, gpu, 1, weights, kv)


def _pick_tp(
    request: PlanRequest, factors: Factors, template: Replica, calibration: Calibration | None
) -> tuple[int, str, list[str]]:
    if request.tp is not None:
        check_tp(template.model, request.tp)
        return request.tp, "given by --tp", []
    if calibration is not None:
        check_tp(template.model, calibration.tp, flag="--calibrate tp")
        return calibration.tp, "the calibration's", []
    choice = choose_tp(template, request.context, factors, _latency_check(request, factors))
    if choice.meets_latency:
        return choice.tp, choice.reason, []
    gpus = template.gpu.gpus_per_node
    return choice.tp, choice.reason, [f"no TP up to {gpus} meets the latency target at batch 1"]


def _latency_check(request: PlanRequest, factors: Factors) -> Callable[[Replica], bool] | None:
    if request.tpot_slo_ms is None and request.ttft_slo_ms is None and request.mode != "streams":
        return None

    def meets(replica: Replica) -> bool:
        trial = Setup.roofline(request, factors, replica)
        return trial.limits(1).met_by(trial.point_at()(1))

    return meets


def _check_fit(setup: Setup) -> None:
    replica, tokens = setup.replica, setup.sequence_tokens
    if setup.fit.max_seqs(tokens) >= 1:
        return
    fitting = [
        tp
        for tp in tp_options(replica.model, replica.gpu.gpus_per_node)
        if memory_fit(msgspec.structs.replace(replica, tp=tp), setup.factors).max_seqs(tokens)
    ]
    hint = f"smallest TP that does: {fitting[0]}" if fitting else "no TP within a node does"
    raise PlanError(
        f"--tp: at TP={replica.tp}, {replica.model.name} needs "
        f"{setup.fit.weights_bytes_per_gpu / GIB:,.1f} GiB of weights per GPU and "
        f"{replica.gpu.name} has {setup.fit.usable_bytes_per_gpu / GIB:,.1f} GiB usable, "
        f"no room for the KV of one {tokens:,}-token sequence; {hint}"
    )


def _replica_warnings(setup: Setup) -> list[str]:
    replica, request, factors = setup.replica, setup.request, setup.factors
    model, gpu, warnings = replica.model, replica.gpu, []
    if replica.crosses_node:
        warnings.append(
            f"TP={replica.tp} spans {-(-replica.tp // gpu.gpus_per_node)} nodes of "
            f"{gpu.gpus_per_node} GPUs: every layer's all-reduces cross the network (modelled "
            f"at {factors.internode_gb_s:g} GB/s); prefer pipeline parallelism across nodes"
        )
    seqs = setup.fit.max_seqs(request.context)
    if seqs < factors.min_kv_seqs:
        warnings.append(
            f"TP={replica.tp} leaves KV room for only {seqs} sequence(s) of "
            f"{request.context:,} tokens (a useful budget holds {factors.min_kv_seqs})"
        )
    if model.max_context and request.context > model.max_context:
        warnings.append(
            f"--context {request.context:,} exceeds {model.name}'s max_position_embeddings "
            f"({model.max_context:,})"
        )
    if replica.weights_dtype == "fp8" and gpu.fp8_tflops == 0:
        warnings.append(f"{gpu.name} has no fp8 tensor cores: fp8 weights run with bf16 math")
    return warnings
