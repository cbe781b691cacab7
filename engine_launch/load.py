"""Read an engine's load from vLLM's Prometheus text (pure)."""

from __future__ import annotations

from hpcserve.router.protocol import ReplicaLoad

_FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_vllm_load(metrics_text: str) -> ReplicaLoad:
    """Sum each gauge over its label sets (one per engine / model name)."""
    totals = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
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
    )
