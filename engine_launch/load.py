"""Read an engine's load from vLLM's Prometheus text (pure)."""

from __future__ import annotations

import contextlib
import math
import re

from hpcserve.contracts.protocol import LatencyHistogram, ReplicaLoad

_FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


_CACHE_INFO = "vllm:cache_config_info{"
# Histograms reported for the autoscaler's SLO signal (ReplicaLoad.ttft / tpot).
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds_bucket": "ttft",
    "vllm:request_time_per_output_token_seconds_bucket": "tpot",
}
_SUMS = {
    "vllm:time_to_first_token_seconds_sum": "ttft",
    "vllm:request_time_per_output_token_seconds_sum": "tpot",
}
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _kv_capacity_tokens(line: str) -> int:
    """num_gpu_blocks x block_size from vLLM's cache_config_info labels (0: not there)."""
    labels = dict(_LABEL.findall(line.partition("{")[2].rpartition("}")[0]))
    try:
        return int(labels.get("num_gpu_blocks", 0)) * int(labels.get("block_size", 0))
    except ValueError:
        return 0


def parse_vllm_load(metrics_text: str) -> ReplicaLoad:
    """Sum each gauge over its label sets (one per engine / model name)."""
    totals = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    capacity = 0
    buckets: dict[str, dict[float, float]] = {"ttft": {}, "tpot": {}}
    sums = {"ttft": 0.0, "tpot": 0.0}
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:"):
            continue
        if line.startswith(_CACHE_INFO):
            capacity += _kv_capacity_tokens(line)
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        histogram = _HISTOGRAMS.get(line[:name_end]) if name_end > 0 else None
        if histogram is not None:
            _add_bucket(buckets[histogram], line)
            continue
        summed = _SUMS.get(line[:name_end]) if name_end > 0 else None
        if summed is not None:
            with contextlib.suppress(IndexError, ValueError):
                sums[summed] += float(line.rsplit(" ", 1)[1])
            continue
        field = _FIELDS.get(line[:name_end]) if name_end > 0 else None
        if field is None:
            continue
        try:
            totals[field] += float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return ReplicaLoad(
        running=int(totals["running"]),
        waiting=int(totals["waiting"]),
        kv_usage=min(max(totals["kv_usage"], 0.0), 1.0),
        kv_capacity_tokens=capacity,
        ttft=_histogram(buckets["ttft"], sums["ttft"]),
        tpot=_histogram(buckets["tpot"], sums["tpot"]),
    )


def _add_bucket(into: dict[float, float], line: str) -> None:
    """One `_bucket{...,le="0.5"} 12` line, summed over label sets by bound."""
    labels = dict(_LABEL.findall(line.partition("{")[2].rpartition("}")[0]))
    try:
        bound = float(labels["le"])  # "+Inf" parses as inf
        into[bound] = into.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    except (KeyError, IndexError, ValueError):
        return


def _histogram(buckets: dict[float, float], total_s: float) -> LatencyHistogram | None:
    if not buckets:
        return None
    bounds = sorted(b for b in buckets if math.isfinite(b))
    total = buckets.get(math.inf, buckets[bounds[-1]] if bounds else 0.0)
    observed = total_s if math.isfinite(total_s) and total_s > 0 else 0.0
    return LatencyHistogram(bounds, [int(buckets[b]) for b in bounds], int(total), observed)
