"""The plan's answer: a msgspec Struct per section, each saying how it was estimated.

Every section carries ``basis`` (what its figures come from) and ``wrong_if`` (what would
make them wrong); ``PlanReport.estimate`` is always true. ``msgspec.json.encode(report)``
is the ``--json`` output.
"""

from __future__ import annotations

import msgspec

from hpcserve.planner.economics import Economics
from hpcserve.planner.factors import Factors
from hpcserve.planner.fleet import BatchJob, FleetSize
from hpcserve.planner.gpus import GPUSpec
from hpcserve.planner.pd import Link, PDComparison, Shape
from hpcserve.planner.request import PlanRequest

NOTE = (
    "Estimates, not measurements: arithmetic on datasheet figures, the model's architecture "
    "and the assumed factors listed (or measured throughput where --calibrate is given). "
    "Check them against a benchmark before buying or reserving GPUs."
)


class ModelInfo(msgspec.Struct, frozen=True):
    name: str
    source: str
    params_total: int
    params_active: int
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_per_token: int
    max_context: int


class MemoryReport(msgspec.Struct, frozen=True):
    tp: int
    tp_reason: str
    gpus_per_node: int
    crosses_node: bool
    weights_dtype: str
    kv_dtype: str
    context: int
    weights_gib: float
    weights_gib_per_gpu: float
    usable_gib_per_gpu: float  # memory x gpu_memory_utilization - runtime overhead
    kv_bytes_per_token: float  # 2 x layers x KV heads x head dim x bytes, whole model
    kv_bytes_per_token_stored: float  # per replica, with KV heads replicated when TP > KV heads
    kv_gib_per_sequence: float  # at ``context``
    kv_budget_gib: float  # per replica
    kv_tokens: int  # per replica
    max_seqs: int  # concurrent sequences of ``context`` tokens per replica
    basis: str
    wrong_if: list[str]


class DecodeRow(msgspec.Struct, frozen=True):
    batch: int
    tpot_ms: float
    tokens_per_s: float  # whole replica
    tokens_per_s_per_stream: float
    bound: str


class PerformanceReport(msgspec.Struct, frozen=True):
    basis: str
    decode_context: int  # context of every decoding sequence in the table
    single_stream_bound_tps: float | None  # peak HBM / bytes per step; None when calibrated
    decode: list[DecodeRow]
    max_batch: int
    max_batch_limit: str  # "KV cache" or "max_num_seqs"
    compute_bound_batch: int | None  # smallest batch whose decode step is compute-bound
    prefill_tokens_per_s: float
    at_batch: int
    prompt_tokens: int
    ttft_ms: float  # that prompt, sharing steps with at_batch - 1 decoding sequences
    tpot_ms: float
    wrong_if: list[str]


class FleetReport(msgspec.Struct, frozen=True):
    workload: str  # "streams" or "requests"
    demand: float
    demand_unit: str
    slo: str
    slo_met: bool
    batch_per_replica: int  # the largest batch within the SLO: a replica's capacity
    capacity_per_replica: float  # in demand units, at that batch
    output_tokens_per_s_per_replica: float
    ttft_ms: float  # at that batch
    tpot_ms: float
    sizing_load: float
    size: FleetSize
    demand_per_replica: float  # the demand spread over the serving replicas (spares idle)
    batch_at_demand: int  # where a replica settles under that demand
    ttft_ms_at_demand: float
    tpot_ms_at_demand: float
    basis: str
    wrong_if: list[str]


class BudgetReport(msgspec.Struct, frozen=True):
    gpus: int
    replicas: int
    concurrent_seqs: int  # of ``context`` tokens
    output_tokens_per_s: float  # decode at the largest batch, whole budget


class BatchJobReport(msgspec.Struct, frozen=True):
    batch_per_replica: int
    job: BatchJob
    cost_usd: float  # GPU-hours x $/GPU-hour
    api_cost_usd: float | None  # the same tokens at the API prices, when both are given
    basis: str
    wrong_if: list[str]


class EconomicsReport(msgspec.Struct, frozen=True):
    costs: Economics
    priced: str  # what the per-token figures are for
    placeholder_price: bool
    wrong_if: list[str]


class PDReport(msgspec.Struct, frozen=True):
    """Disaggregated prefill/decode vs colocated replicas on the same GPUs (pd.py)."""

    gpus: int
    replicas: int  # of TP GPUs each
    mix: list[Shape]
    link: Link
    kv_bytes_per_token: float  # whole model, the bytes a prompt token's KV moves
    comparison: PDComparison
    ratio: str  # the proposed prefill:decode split, e.g. "5:3"
    verdict: str
    demand_rps: float | None  # the requests workload's rate, if given
    basis: str
    wrong_if: list[str]


class PlanReport(msgspec.Struct, frozen=True):
    request: PlanRequest
    model: ModelInfo
    gpu: GPUSpec
    factors: Factors
    memory: MemoryReport
    performance: PerformanceReport
    economics: EconomicsReport
    fleet: FleetReport | None = None
    budget: BudgetReport | None = None
    batch_job: BatchJobReport | None = None
    warnings: list[str] = msgspec.field(default_factory=list)
    estimate: bool = True
    note: str = NOTE
    pd: PDReport | None = None
