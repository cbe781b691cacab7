"""Builders of the report's sections from a resolved Setup; one function per section."""

from __future__ import annotations

from collections.abc import Callable

from hpcserve.planner import caveats
from hpcserve.planner.capacity import (
    OperatingPoint,
    best_point,
    point_for_demand,
    requests_point,
)
from hpcserve.planner.economics import Traffic, economics
from hpcserve.planner.errors import PlanError
from hpcserve.planner.fleet import batch_job, budget_concurrency, size_fleet
from hpcserve.planner.models import ModelSpec
from hpcserve.planner.perfmodel import Roofline, decode_step, prefill_tokens_per_s
from hpcserve.planner.replica import GIB, kv_bytes_per_token
from hpcserve.planner.report import (
    BatchJobReport,
    BudgetReport,
    DecodeRow,
    EconomicsReport,
    FleetReport,
    MemoryReport,
    ModelInfo,
    PerformanceReport,
)
from hpcserve.planner.request import DEFAULT_GPU_HOUR_USD
from hpcserve.planner.setup import Setup

ARITHMETIC = "estimate: arithmetic on the architecture, the GPU catalog and the factors"
ROOFLINE = "estimate: roofline on the architecture, the GPU catalog and the factors"


def model_info(model: ModelSpec) -> ModelInfo:
    return ModelInfo(
        name=model.name,
        source=model.source,
        params_total=model.params_total,
        params_active=model.params_active,
        layers=model.layers,
        hidden_size=model.hidden_size,
        heads=model.heads,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        experts=model.experts,
        experts_per_token=model.experts_per_token,
        max_context=model.max_context,
    )


def memory_report(setup: Setup) -> MemoryReport:
    replica, fit, context = setup.replica, setup.fit, setup.request.context
    stored = fit.kv_bytes_per_token_per_gpu * replica.tp
    return MemoryReport(
        tp=replica.tp,
        tp_reason=setup.tp_reason,
        gpus_per_node=replica.gpu.gpus_per_node,
        crosses_node=replica.crosses_node,
        weights_dtype=replica.weights_dtype,
        kv_dtype=replica.kv_dtype,
        context=context,
        weights_gib=fit.weights_bytes_per_gpu * replica.tp / GIB,
        weights_gib_per_gpu=fit.weights_bytes_per_gpu / GIB,
        usable_gib_per_gpu=fit.usable_bytes_per_gpu / GIB,
        kv_bytes_per_token=kv_bytes_per_token(replica.model, replica.kv_dtype),
        kv_bytes_per_token_stored=stored,
        kv_gib_per_sequence=stored * fit.blocks_per_seq(context) * fit.kv_block_tokens / GIB,
        kv_budget_gib=fit.kv_tokens * stored / GIB,
        kv_tokens=fit.kv_tokens,
        max_seqs=fit.max_seqs(context),
        basis=ARITHMETIC,
        wrong_if=caveats.memory_caveats(replica, setup.factors),
    )


def _decode_rows(setup: Setup, max_batch: int, extra: list[int]) -> list[DecodeRow]:
    batches = {b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= max_batch}
    batches |= {b for b in [max_batch, *extra] if 1 <= b <= max_batch}
    rows = []
    for batch in sorted(batches):
        step = setup.model.step_time(decode_step(batch, setup.decode_context))
        tps = batch / step.total_s
        rows.append(DecodeRow(batch, step.total_s * 1e3, tps, tps / batch, step.bound))
    return rows


def _compute_bound_batch(setup: Setup, max_batch: int) -> int | None:
    if setup.calibrated:
        return None
    for batch in range(1, max_batch + 1):
        if setup.model.step_time(decode_step(batch, setup.decode_context)).bound == "compute":
            return batch
    return None


def performance_report(setup: Setup, at_batch: int | None) -> PerformanceReport:
    """Decode at batch sizes up to the KV/engine limit, prefill, TTFT/TPOT at one batch."""
    max_batch, limit = setup.max_batch()
    batch = at_batch or max_batch
    if batch > max_batch:
        raise PlanError(
            f"--batch: {batch} exceeds the largest batch of this replica, {max_batch} "
            f"({limit}, sequences of {setup.sequence_tokens:,} tokens)"
        )
    knee = _compute_bound_batch(setup, max_batch)
    point = setup.point_at()(batch)
    prompt = setup.prompt_tokens
    model = setup.model
    return PerformanceReport(
        basis=model.basis if setup.calibrated else ROOFLINE,
        decode_context=setup.decode_context,
        single_stream_bound_tps=None
        if setup.calibrated
        else Roofline(setup.replica, setup.factors).single_stream_bound_tps(setup.decode_context),
        decode=_decode_rows(setup, max_batch, [batch, knee or 0]),
        max_batch=max_batch,
        max_batch_limit=limit,
        compute_bound_batch=knee,
        prefill_tokens_per_s=prefill_tokens_per_s(
            model, prompt, token_budget=setup.factors.max_num_batched_tokens
        ),
        at_batch=batch,
        prompt_tokens=prompt,
        ttft_ms=point.ttft_s * 1e3,
        tpot_ms=point.tpot_s * 1e3,
        wrong_if=caveats.performance_caveats(setup.calibrated, setup.factors),
    )


def _slo_text(setup: Setup) -> str:
    limits, parts = setup.limits(1), []
    if limits.tpot_s is not None:
        parts.append(f"TPOT <= {limits.tpot_s * 1e3:.1f} ms")
    if limits.ttft_s is not None:
        parts.append(f"TTFT <= {limits.ttft_s * 1e3:.0f} ms ({setup.prompt_tokens:,}-token prompt)")
    return ", ".join(parts) or "none (throughput only)"


def fleet_report(setup: Setup) -> FleetReport | None:
    """Replicas for the workload at the largest batch meeting the latency limits."""
    req, factors, replica = setup.request, setup.factors, setup.replica
    if req.mode == "none":
        return None
    max_batch, _ = setup.max_batch()
    point, met = best_point(setup.point_at(), setup.limits(max_batch))
    if req.mode == "streams":
        demand, unit = float(req.concurrent_streams or 0), "streams"
    else:
        demand, unit = req.requests_per_s or 0.0, "requests/s"
    capacity = _capacity(req.mode)
    if not met:
        setup.warnings.append(
            f"the latency target ({_slo_text(setup)}) is not met at TP={replica.tp} on "
            f"{replica.gpu.name} even at batch 1 (TPOT {point.tpot_s * 1e3:.1f} ms, TTFT "
            f"{point.ttft_s * 1e3:.0f} ms): sized at batch 1; try a larger --tp, fp8 or a "
            "faster GPU"
        )
    size = size_fleet(
        demand,
        capacity(point),
        tp=replica.tp,
        gpus_per_node=replica.gpu.gpus_per_node,
        spares=req.spares,
        load=factors.sizing_load,
    )
    share = demand / size.replicas_needed
    settled = point_for_demand(setup.point_at(), share, capacity, point.batch)
    return FleetReport(
        workload=req.mode,
        demand=demand,
        demand_unit=unit,
        slo=_slo_text(setup),
        slo_met=met,
        batch_per_replica=point.batch,
        capacity_per_replica=capacity(point),
        output_tokens_per_s_per_replica=point.output_tokens_per_s,
        ttft_ms=point.ttft_s * 1e3,
        tpot_ms=point.tpot_s * 1e3,
        sizing_load=factors.sizing_load,
        size=size,
        demand_per_replica=share,
        batch_at_demand=settled.batch,
        ttft_ms_at_demand=settled.ttft_s * 1e3,
        tpot_ms_at_demand=settled.tpot_s * 1e3,
        basis=f"{setup.model.basis} step times; replicas = ceil(demand / (capacity x "
        f"{factors.sizing_load:g})) + {req.spares} spare(s)",
        wrong_if=caveats.fleet_caveats(req.mode, factors),
    )


def _capacity(mode: str) -> Callable[[OperatingPoint], float]:
    """What a replica at an operating point carries, in the workload's demand unit."""
    if mode == "streams":
        return lambda point: float(point.batch)
    return lambda point: point.requests_per_s


def budget_report(setup: Setup) -> BudgetReport | None:
    gpus, tp = setup.request.gpus, setup.replica.tp
    if gpus is None:
        return None
    if gpus < tp:
        raise PlanError(f"--gpus: {gpus} GPUs hold no replica of TP={tp}")
    max_batch, _ = setup.max_batch(setup.request.context)
    step = setup.model.step_time(decode_step(max_batch, setup.request.context))
    replicas = gpus // tp
    seqs = budget_concurrency(gpus, tp, setup.fit.max_seqs(setup.request.context))
    return BudgetReport(gpus, replicas, seqs, replicas * max_batch / step.total_s)


def batch_job_report(setup: Setup) -> BatchJobReport | None:
    """GPU-hours of the batch job with every replica at its largest batch."""
    req = setup.request
    if req.batch_job is None:
        return None
    docs, prompt, output = req.batch_job
    max_batch, _ = setup.max_batch(prompt + output)
    budget = setup.factors.max_num_batched_tokens
    point = requests_point(
        setup.model, max_batch, prompt=prompt, output=output, token_budget=budget
    )
    job = batch_job(
        docs,
        prompt,
        output,
        point.requests_per_s,
        tp=setup.replica.tp,
        window_h=req.batch_window_h,
        budget_gpus=req.gpus,
    )
    if job.fits_window is False:
        setup.warnings.append(
            f"the batch job takes {job.hours_on_budget:,.1f} h on {req.gpus} GPUs, more than "
            f"the {req.batch_window_h:g} h window: it needs {job.gpus_for_window} GPUs"
        )
    api_in, api_out = req.api_usd_per_m_input, req.api_usd_per_m_output
    api = docs * (prompt * api_in + output * api_out) / 1e6 if api_in and api_out else None
    return BatchJobReport(
        batch_per_replica=max_batch,
        job=job,
        cost_usd=job.gpu_hours * (req.gpu_hour_usd or DEFAULT_GPU_HOUR_USD),
        api_cost_usd=api,
        basis=f"{setup.model.basis} step times at batch {max_batch}, prefill mixed into decode",
        wrong_if=caveats.batch_caveats(),
    )


def economics_report(
    setup: Setup, fleet: FleetReport | None, perf: PerformanceReport
) -> EconomicsReport:
    """Costs of the sized fleet (spares billed, not serving), else of one replica."""
    req, replica = setup.request, setup.replica
    batch = fleet.batch_per_replica if fleet else perf.at_batch
    serving = fleet.size.replicas_needed if fleet else 1
    step = setup.model.step_time(decode_step(batch, setup.decode_context))
    rate = fleet.capacity_per_replica if fleet and req.mode == "requests" else None
    traffic = Traffic(
        output_tokens_per_s=serving * batch / step.total_s,
        input_tokens_per_s=serving * perf.prefill_tokens_per_s,
        requests_per_s=serving * rate if rate else None,
        prompt_tokens=req.prompt_tokens,
        output_tokens=req.output_tokens,
    )
    gpus = fleet.size.gpus if fleet else replica.tp
    priced = (
        f"the sized fleet ({gpus} GPU(s), spares included) at batch {batch}"
        if fleet
        else f"one replica ({gpus} GPU(s)) at batch {batch}"
    )
    placeholder = req.gpu_hour_usd is None
    costs = economics(
        traffic,
        gpus_billed=gpus,
        gpu_hour_usd=req.gpu_hour_usd or DEFAULT_GPU_HOUR_USD,
        utilisation=req.utilisation,
        api_usd_per_m_input=req.api_usd_per_m_input,
        api_usd_per_m_output=req.api_usd_per_m_output,
    )
    return EconomicsReport(costs, priced, placeholder, caveats.economics_caveats(placeholder))
