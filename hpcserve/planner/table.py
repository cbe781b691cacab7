"""The plan as a readable text table: one block per report section."""

from __future__ import annotations

import textwrap

import msgspec

from hpcserve.planner.factors import Factors
from hpcserve.planner.report import (
    BatchJobReport,
    BudgetReport,
    EconomicsReport,
    FleetReport,
    MemoryReport,
    PDReport,
    PerformanceReport,
    PlanReport,
)

WIDTH = 100


def _row(label: str, value: str, note: str = "") -> str:
    line = f"  {label:<24} {value}"
    return f"{line:<42}  {note}" if note else line


def _wrap(text: str, indent: str = "  ", first: str | None = None) -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent if first is None else first,
        subsequent_indent=indent + "  ",
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _header(report: PlanReport) -> list[str]:
    m, g = report.model, report.gpu
    params = f"{m.params_total / 1e9:.2f} B parameters"
    if m.experts > 1:
        params += (
            f" ({m.params_active / 1e9:.2f} B active: {m.experts_per_token} of {m.experts} experts)"
        )
    fp8 = f", {g.fp8_tflops:,g} fp8" if g.fp8_tflops else ", no fp8"
    return [
        f"hpcserve plan: {m.name} on {g.name} -- estimates, not measurements",
        "",
        f"Model    {m.name} ({m.source}): {params}, {m.layers} layers, {m.heads} heads, "
        f"{m.kv_heads} KV heads x {m.head_dim}",
        *_wrap(
            f"GPU      {g.name}: {g.memory_gib:g} GiB, {g.hbm_gb_s:,g} GB/s HBM, "
            f"{g.bf16_tflops:,g} TFLOP/s bf16{fp8}, {g.interconnect} {g.interconnect_gb_s:g} GB/s, "
            f"{g.gpus_per_node} per node",
            "       ",
            "",
        ),
        *_wrap(f"Replica  TP={report.memory.tp}: {report.memory.tp_reason}", "       ", ""),
    ]


def _memory(mem: MemoryReport, factors: Factors) -> list[str]:
    usable = f"x {factors.gpu_memory_utilization:g} - {factors.runtime_overhead_gib:g} GiB runtime"
    stored = []
    if mem.kv_bytes_per_token_stored != mem.kv_bytes_per_token:
        stored = [
            _row(
                "KV stored per token",
                f"{mem.kv_bytes_per_token_stored:,.0f} B",
                "KV heads replicated: TP > KV heads",
            )
        ]
    return [
        f"Memory per replica ({mem.weights_dtype} weights, {mem.kv_dtype} KV, context "
        f"{mem.context:,})",
        _row(
            "weights", f"{mem.weights_gib:,.2f} GiB", f"{mem.weights_gib_per_gpu:,.2f} GiB per GPU"
        ),
        _row("usable per GPU", f"{mem.usable_gib_per_gpu:,.2f} GiB", usable),
        _row(
            "KV cache per token",
            f"{mem.kv_bytes_per_token:,.0f} B",
            "2 x layers x KV heads x head dim x bytes",
        ),
        *stored,
        _row("KV per sequence", f"{mem.kv_gib_per_sequence:,.3f} GiB", f"{mem.context:,} tokens"),
        _row("KV budget", f"{mem.kv_budget_gib:,.2f} GiB", f"{mem.kv_tokens:,} tokens"),
        _row("concurrent sequences", f"{mem.max_seqs:,}", f"of {mem.context:,} tokens"),
    ]


def _performance(perf: PerformanceReport, mode: str) -> list[str]:
    mixed = "; prefill mixed in" if mode == "requests" else ""
    lines = [f"Throughput per replica ({perf.basis})"]
    if perf.single_stream_bound_tps is not None:
        lines.append(
            _row(
                "single-stream bound",
                f"{perf.single_stream_bound_tps:,.0f} tok/s",
                "peak HBM / bytes read per step",
            )
        )
    lines += [
        _row(
            "prefill",
            f"{perf.prefill_tokens_per_s:,.0f} tok/s",
            f"{perf.prompt_tokens:,}-token prompt",
        ),
        f"  decode, every sequence at {perf.decode_context:,} tokens of context:",
        f"    {'batch':>6} {'TPOT ms':>9} {'tok/s':>9} {'tok/s/stream':>13}  bound",
    ]
    for row in perf.decode:
        lines.append(
            f"    {row.batch:>6} {row.tpot_ms:>9.2f} {row.tokens_per_s:>9,.0f} "
            f"{row.tokens_per_s_per_stream:>13,.1f}  {row.bound}"
        )
    knee = (
        "never up to it"
        if perf.compute_bound_batch is None
        else f"from batch {perf.compute_bound_batch}"
    )
    if perf.basis.startswith("measured"):
        knee = "not modelled (measured)"
    lines.append(
        _row(
            "largest batch", f"{perf.max_batch:,}", f"{perf.max_batch_limit}; compute-bound {knee}"
        )
    )
    lines.append(
        _row(
            f"at batch {perf.at_batch}",
            f"TTFT {perf.ttft_ms:,.0f} ms, TPOT {perf.tpot_ms:,.1f} ms",
            f"{perf.prompt_tokens:,}-token prompt{mixed}",
        )
    )
    return lines


def _fleet(fleet: FleetReport) -> list[str]:
    size = fleet.size
    digits = 2 if fleet.workload == "requests" else 0
    per_replica = f"{fleet.capacity_per_replica:,.{digits}f} {fleet.demand_unit}"
    nodes = (
        f"{size.replicas_per_node} replicas per node"
        if size.replicas_per_node
        else "replicas span nodes"
    )
    share = f"{fleet.demand_per_replica:,.{digits}f} {fleet.demand_unit}"
    return [
        f"Fleet for {fleet.demand:,g} {fleet.demand_unit} (SLO: {fleet.slo})",
        _row(
            "capacity per replica",
            per_replica,
            f"batch {fleet.batch_per_replica} (largest within the SLO), "
            f"{fleet.output_tokens_per_s_per_replica:,.0f} output tok/s",
        ),
        _row(
            "latency at capacity",
            f"TTFT {fleet.ttft_ms:,.0f} ms, TPOT {fleet.tpot_ms:,.1f} ms",
            "SLO met" if fleet.slo_met else "SLO NOT met",
        ),
        _row(
            "at demand, spares idle",
            f"{share} per replica",
            f"batch {fleet.batch_at_demand}: TTFT {fleet.ttft_ms_at_demand:,.0f} ms, "
            f"TPOT {fleet.tpot_ms_at_demand:,.1f} ms",
        ),
        _row(
            "replicas",
            f"{size.replicas_needed} + {size.spares} spare = {size.replicas}",
            f"sized at {fleet.sizing_load:.0%} load",
        ),
        _row("GPUs", f"{size.gpus:,} on {size.nodes:,} node(s)", nodes),
    ]


def _budget(budget: BudgetReport) -> list[str]:
    return [
        f"GPU budget of {budget.gpus:,} GPUs",
        _row("replicas", f"{budget.replicas:,}"),
        _row("concurrent sequences", f"{budget.concurrent_seqs:,}", "KV capacity at the context"),
        _row(
            "decode",
            f"{budget.output_tokens_per_s:,.0f} tok/s",
            "every replica at its largest batch",
        ),
    ]


def _batch_job(report: BatchJobReport) -> list[str]:
    job = report.job
    lines = [
        f"Batch job: {job.docs:,} documents x {job.input_tokens:,} input + "
        f"{job.output_tokens:,} output tokens",
        _row(
            "per replica",
            f"{job.docs_per_s_per_replica:,.2f} docs/s",
            f"batch {report.batch_per_replica}",
        ),
        _row("GPU-hours", f"{job.gpu_hours:,.1f}", f"{job.replica_hours:,.1f} replica-hours"),
        _row("cost", f"${report.cost_usd:,.0f}", "GPU-hours x $/GPU-hour"),
    ]
    if report.api_cost_usd is not None:
        lines.append(_row("same tokens at the API", f"${report.api_cost_usd:,.0f}"))
    if job.window_h is not None:
        lines.append(
            _row(
                f"to finish in {job.window_h:g} h",
                f"{job.replicas_for_window} replicas",
                f"{job.gpus_for_window} GPUs",
            )
        )
    if job.budget_gpus is not None:
        fits = {None: "", True: "fits the window", False: "does NOT fit the window"}[
            job.fits_window
        ]
        lines.append(_row(f"on {job.budget_gpus} GPUs", f"{job.hours_on_budget:,.1f} h", fits))
    return lines


def _pd(report: PDReport) -> list[str]:
    c = report.comparison
    mix = ", ".join(f"{s.share:.0%} {s.prompt:,}->{s.output:,}" for s in report.mix)
    tpot = "every token gap (ITL p95)" if c.per_token else "each request's mean (TPOT p95)"
    transfer = ", ".join(f"{ms:,.1f}" for ms in c.transfer_ms)
    lines = [
        f"Disaggregated prefill/decode on {report.gpus} GPUs ({report.replicas} replicas)",
        _row("mix (prompt->output)", mix),
        _row(
            "KV transfer",
            f"{transfer} ms per prompt",
            f"{report.link.name}, {report.kv_bytes_per_token / 1024:,.0f} KiB/token",
        ),
        _row("TPOT SLO read as", tpot),
        _row("colocated goodput", f"{c.colocated_rps:,.2f} requests/s"),
        _row(
            f"PD goodput at {report.ratio}",
            f"{c.pd_rps:,.2f} requests/s",
            f"{c.gain:+.0%}" if c.colocated_rps > 0 else "",
        ),
        _row(
            "splits (p:d rps)",
            " ".join(f"{s.prefill}:{s.decode}={s.goodput_rps:,.1f}" for s in c.splits),
        ),
    ]
    if report.demand_rps is not None:
        best = max(c.colocated_rps, c.pd_rps)
        met = "met" if best >= report.demand_rps else "NOT met by either layout"
        lines.append(_row("demand", f"{report.demand_rps:,g} requests/s", met))
    return [*lines, *_wrap(report.verdict, "  ", "  => ")]


def _economics(econ: EconomicsReport) -> list[str]:
    c = econ.costs
    price = f"${c.gpu_hour_usd:g}/GPU-hour" + (" (placeholder)" if econ.placeholder_price else "")
    lines = [
        f"Economics: {price}, {c.utilisation:.0%} average utilisation; {econ.priced}",
        _row("monthly", f"${c.monthly_usd:,.0f}", f"{c.gpus_billed} GPU(s) x 730 h"),
        _row("per M output tokens", f"${c.usd_per_m_output:,.3f}"),
        _row("per M input tokens", f"${c.usd_per_m_input:,.3f}"),
    ]
    if c.api_usd_per_m_output is not None or c.api_usd_per_m_input is not None:
        api_in, api_out = c.api_usd_per_m_input, c.api_usd_per_m_output
        lines.append(_row("API price per M tokens", f"${api_in or 0:g} in / ${api_out or 0:g} out"))
        even = f"output {_pct(c.break_even_output)}, input {_pct(c.break_even_input)}"
        if c.break_even_workload is not None:
            even += f", this workload {_pct(c.break_even_workload)}"
        lines.append(_row("break-even utilisation", even))
    return lines


def _caveats(report: PlanReport) -> list[str]:
    lines = ["What would make these wrong"]
    sections = [
        ("memory", report.memory.wrong_if),
        ("throughput", report.performance.wrong_if),
        ("fleet", report.fleet.wrong_if if report.fleet else []),
        ("batch job", report.batch_job.wrong_if if report.batch_job else []),
        ("PD", report.pd.wrong_if if report.pd else []),
        ("economics", report.economics.wrong_if),
    ]
    for name, notes in sections:
        for note in notes:
            lines += _wrap(f"{name}: {note}")
    factors = msgspec.structs.asdict(report.factors)
    listed = ", ".join(f"{k}={v:g}" for k, v in factors.items())
    return [*lines, "", *_wrap(f"Assumed factors: {listed}", "", "")]


def format_report(report: PlanReport) -> str:
    blocks = [
        _header(report),
        _memory(report.memory, report.factors),
        _performance(report.performance, report.request.mode),
    ]
    if report.fleet:
        blocks.append(_fleet(report.fleet))
    if report.budget:
        blocks.append(_budget(report.budget))
    if report.batch_job:
        blocks.append(_batch_job(report.batch_job))
    if report.pd:
        blocks.append(_pd(report.pd))
    blocks.append(_economics(report.economics))
    if report.warnings:
        warnings = [line for w in report.warnings for line in _wrap(w, "    ", "  ! ")]
        blocks.append(["Warnings", *warnings])
    blocks.append(_caveats(report))
    blocks.append(_wrap(report.note, "", ""))
    return "\n\n".join("\n".join(_fit(line) for line in block) for block in blocks)


def _fit(line: str) -> str:
    """Wrap a line longer than WIDTH, continuing under its own indent plus four."""
    if len(line) <= WIDTH:
        return line
    lead = " " * (len(line) - len(line.lstrip()))
    return "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent=lead + "    "))
