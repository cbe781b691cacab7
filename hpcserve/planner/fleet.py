"""Fleet arithmetic: replicas, spares and nodes for a demand; GPU-hours of a batch job.

Pure functions of throughput figures, so each can be checked by hand.
"""

from __future__ import annotations

import math

import msgspec

from hpcserve.planner.errors import PlanError

_EPS = 1e-9  # so that 3.0000000001 replicas' worth of demand is 3, not 4


def _ceil(value: float) -> int:
    return math.ceil(value - _EPS)


class FleetSize(msgspec.Struct, frozen=True):
    replicas_needed: int  # to carry the demand at ``load`` of each replica's capacity
    spares: int
    replicas: int  # needed + spares
    gpus_per_replica: int
    gpus: int
    replicas_per_node: int  # 0 when one replica spans nodes
    nodes: int


def size_fleet(
    demand: float,
    capacity_per_replica: float,
    *,
    tp: int,
    gpus_per_node: int,
    spares: int = 1,
    load: float = 1.0,
) -> FleetSize:
    """replicas = ceil(demand / (capacity x load)) + spares, packed whole onto nodes."""
    needed = max(1, _ceil(demand / (capacity_per_replica * load)))
    replicas = needed + spares
    if tp <= gpus_per_node:
        per_node = gpus_per_node // tp
        nodes = math.ceil(replicas / per_node)
    else:
        per_node = 0
        nodes = replicas * math.ceil(tp / gpus_per_node)
    return FleetSize(needed, spares, replicas, tp, replicas * tp, per_node, nodes)


def budget_concurrency(budget_gpus: int, tp: int, seqs_per_replica: int) -> int:
    """Sequences a GPU budget holds at once: whole replicas x sequences each."""
    return (budget_gpus // tp) * seqs_per_replica


class BatchJob(msgspec.Struct, frozen=True):
    docs: int
    input_tokens: int  # per document
    output_tokens: int  # per document
    docs_per_s_per_replica: float
    replica_hours: float
    gpu_hours: float
    window_h: float | None = None
    replicas_for_window: int | None = None
    gpus_for_window: int | None = None
    budget_gpus: int | None = None
    hours_on_budget: float | None = None  # wall-clock on the budget's whole replicas
    fits_window: bool | None = None


def batch_job(
    docs: int,
    input_tokens: int,
    output_tokens: int,
    docs_per_s_per_replica: float,
    *,
    tp: int,
    window_h: float | None = None,
    budget_gpus: int | None = None,
) -> BatchJob:
    """GPU-hours = docs / (docs/s per replica) / 3600 x TP; replicas to finish in a window.

    With a GPU budget: the wall-clock on the budget's whole replicas and, with a window,
    whether that fits it. Raises PlanError when the budget holds no whole replica.
    """
    replica_hours = docs / docs_per_s_per_replica / 3600
    job = BatchJob(
        docs,
        input_tokens,
        output_tokens,
        docs_per_s_per_replica,
        replica_hours,
        replica_hours * tp,
    )
    if window_h is not None:
        replicas = max(1, _ceil(replica_hours / window_h))
        job = msgspec.structs.replace(
            job, window_h=window_h, replicas_for_window=replicas, gpus_for_window=replicas * tp
        )
    if budget_gpus is not None:
        replicas = budget_gpus // tp
        if replicas < 1:
            raise PlanError(f"--gpus: {budget_gpus} GPUs hold no replica of TP={tp}")
        hours = replica_hours / replicas
        fits = None if window_h is None else hours <= window_h
        job = msgspec.structs.replace(
            job, budget_gpus=budget_gpus, hours_on_budget=hours, fits_window=fits
        )
    return job
