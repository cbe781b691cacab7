"""The gateway's Prometheus metrics, on a registry passed in (never the global one).

Label values are only ever names from the config or the router (endpoints, served
models, tenant names), never client input, so the series cannot grow without bound.

Counted in plain Python numbers (contracts/light_metrics.py): every update runs on the
gateway's event loop thread, so the lock and label lookup that prometheus_client's own
metrics take on each call are not needed on the request path. The request path keeps the
children per (model, tenant) and per (endpoint, model, tenant, status).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from hpcserve.contracts.light_metrics import Counter, Gauge, Histogram, LightCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
_QUEUE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1, 2.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "hpcserve_gateway_requests",
            "Requests by endpoint, model, tenant and status",
            ["endpoint", "model", "tenant", "status"],
        )
        self.latency = Histogram(
            "hpcserve_gateway_request_seconds",
            "Time to the response head (first byte for streams) by endpoint",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
        )
        self.in_flight = Gauge("hpcserve_gateway_in_flight", "Requests being relayed to engines")
        self.ttft = Histogram(
            "hpcserve_gateway_time_to_first_token_seconds",
            "Streamed requests: time from arrival to the engine's first chunk",
            ["model"],
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "hpcserve_gateway_time_per_output_token_seconds",
            "Streamed requests: time per output token after the first",
            ["model"],
            buckets=_TPOT_BUCKETS,
        )
        self.tokens = Counter(
            "hpcserve_gateway_tokens",
            "Tokens from the engines' usage, by model, tenant and direction (in: prompt, "
            "out: completion)",
            ["model", "tenant", "direction"],
        )
        self.queue = Histogram(
            "hpcserve_gateway_queue_seconds",
            "Time a request waited for its routing decision",
            buckets=_QUEUE_BUCKETS,
        )
        self.overflow = Counter(
            "hpcserve_gateway_overflow",
            "Requests sent to the external API because no replica could take them",
            ["model", "tenant"],
        )
        self.retries = Counter(
            "hpcserve_gateway_retries",
            "Requests retried on another replica after a failure before the first byte",
            ["model"],
        )
        self.pd_requests = Counter(
            "hpcserve_gateway_pd_requests",
            "Disaggregated requests by prefill outcome (transferred: prefilled on the prefill "
            "replica, decoded on the decode replica; prefill_failed: the decode replica "
            "computed the prompt itself, reason timeout, unreachable or error; "
            "not_generating: an endpoint without a decode)",
            ["model", "outcome", "reason"],
        )
        self.wake_holds = Counter(
            "hpcserve_gateway_wake_holds",
            "Requests held for a model with no replica whose pool scales to zero, by outcome "
            "(served: a replica came within autoscale.wake_budget_s; timeout: answered 503; "
            "disconnected: the client went away while held, and the gateway stopped asking)",
            ["model", "outcome"],
        )
        self.hints_skipped = Counter(
            "hpcserve_gateway_prefix_hints_skipped",
            "Requests routed without prefix hints: one_replica (they cannot change the "
            "decision), busy (too many prompts waiting to be tokenized)",
            ["reason"],
        )
        self.rejected = Counter(
            "hpcserve_gateway_quota_rejections",
            "Requests refused with 429 by tenant and limit",
            ["tenant", "limit"],
        )
        self.quota_sync_failures = Counter(
            "hpcserve_gateway_quota_sync_failures",
            "Quota reports the router did not answer in time",
        )
        self.auth_failures = Counter(
            "hpcserve_gateway_auth_failures",
            "Requests refused with 401 by reason (missing, malformed, invalid key)",
            ["reason"],
        )
        self.audit_failures = Counter(
            "hpcserve_gateway_audit_failures",
            "Audit log lines that could not be written (gateway.audit_log)",
        )
        self.usage_failures = Counter(
            "hpcserve_gateway_usage_failures",
            "Usage records that could not be written (gateway.usage_dir; hpcserve report "
            "misses their tokens)",
        )
        self.engine_errors = Counter(
            "hpcserve_gateway_engine_errors",
            "Engine failures that reached a client (5xx answers, and failures mid-stream) by "
            "model and status; each is logged with its request id",
            ["model", "status"],
        )
        self.internal_errors = Counter(
            "hpcserve_gateway_internal_errors",
            "Requests answered 500 because the gateway itself raised (logged with the "
            "request id): a bug to report",
            ["endpoint"],
        )
        # Online quality per deployment (gateway/quality.py): by the name asked for, the
        # registry version that answered and the LoRA adapter; staged rollouts compare these.
        deployment = ["model", "version", "adapter"]
        self.answers = Counter(
            "hpcserve_gateway_deployment_answers",
            "Answers (and failed attempts) of replicas by model asked for, version and adapter",
            deployment,
        )
        self.answer_errors = Counter(
            "hpcserve_gateway_deployment_errors",
            "Of those, 5xx answers and engine failures (before or during the answer)",
            deployment,
        )
        self.truncations = Counter(
            "hpcserve_gateway_deployment_truncations",
            'Answers with a choice that ended with finish_reason "length"',
            deployment,
        )
        self.structured = Counter(
            "hpcserve_gateway_deployment_structured",
            "Answers (200) to requests for JSON output (response_format json_object or "
            "json_schema, structured_outputs.json)",
            deployment,
        )
        self.structured_invalid = Counter(
            "hpcserve_gateway_deployment_structured_invalid",
            "Of those, answers whose text is not valid JSON",
            deployment,
        )
        self.refusals = Counter(
            "hpcserve_gateway_deployment_refusals",
            "Answers that open with a refusal phrase (a heuristic: gateway/quality.py)",
            deployment,
        )
        self.deployment_ttft = Histogram(
            "hpcserve_gateway_deployment_ttft_seconds",
            "Streamed answers: time from routing to the engine's first chunk",
            deployment,
            buckets=_LATENCY_BUCKETS,
        )
        registry.register(
            LightCollector(
                [
                    self.answers,
                    self.answer_errors,
                    self.truncations,
                    self.structured,
                    self.structured_invalid,
                    self.refusals,
                    self.deployment_ttft,
                    self.requests,
                    self.latency,
                    self.in_flight,
                    self.ttft,
                    self.tpot,
                    self.tokens,
                    self.queue,
                    self.overflow,
                    self.retries,
                    self.pd_requests,
                    self.wake_holds,
                    self.hints_skipped,
                    self.rejected,
                    self.quota_sync_failures,
                    self.auth_failures,
                    self.audit_failures,
                    self.usage_failures,
                    self.engine_errors,
                    self.internal_errors,
                ]
            )
        )
