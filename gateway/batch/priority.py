"""The engines' priority of a request: vLLM's `--scheduling-policy priority` serves a lower
value first, and a batch request's value is higher than an interactive one's.

Sent as vLLM's `X-Vllm-Priority` header, which wins over a `priority` in the body, so a
client cannot move its own requests ahead. An engine under the default policy (fcfs)
ignores it (vLLM 0.32 and the simulator both).
"""

from __future__ import annotations

PRIORITY_HEADER = "X-Vllm-Priority"
# By tenant class (TenantConfig.priority); Batch API requests always go at "batch".
ENGINE_PRIORITY = {"interactive": "0", "batch": "1"}
