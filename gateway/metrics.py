"""The gateway's Prometheus metrics, on a registry passed in (never the global one).

Label values are only ever names from the config or the router (endpoints, served
models, tenant names), never client input, so the series cannot grow without bound.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)
_QUEUE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1, 2.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "hpcserve_gateway_requests_total",
            "Requests by endpoint, model, tenant and status",
            ["endpoint", "model", "tenant", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "hpcserve_gateway_request_seconds",
            "Time to the response head (first byte for streams) by endpoint",
            ["endpoint"],
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.in_flight = Gauge(
            "hpcserve_gateway_in_flight", "Requests being relayed to engines", registry=registry
        )
        self.ttft = Histogram(
            "hpcserve_gateway_time_to_first_token_seconds",
            "Streamed requests: time from arrival to the engine's first chunk",
            ["model"],
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "hpcserve_gateway_time_per_output_token_seconds",
            "Streamed requests: time per output token after the first",
            ["model"],
            registry=registry,
            buckets=_TPOT_BUCKETS,
        )
        self.tokens = Counter(
            "hpcserve_gateway_tokens_total",
            "Tokens from the engines' usage, by model, tenant and direction (in: prompt, "
            "out: completion)",
            ["model", "tenant", "direction"],
            registry=registry,
        )
        self.queue = Histogram(
            "hpcserve_gateway_queue_seconds",
            "Time a request waited for its routing decision",
            registry=registry,
            buckets=_QUEUE_BUCKETS,
        )
        self.overflow = Counter(
            "hpcserve_gateway_overflow_total",
            "Requests sent to the external API because no replica could take them",
            ["model", "tenant"],
            registry=registry,
        )
        self.retries = Counter(
            "hpcserve_gateway_retries_total",
            "Requests retried on another replica after a failure before the first byte",
            ["model"],
            registry=registry,
        )
        self.rejected = Counter(
            "hpcserve_gateway_quota_rejections_total",
            "Requests refused with 429 by tenant and limit",
            ["tenant", "limit"],
            registry=registry,
        )
        self.quota_sync_failures = Counter(
            "hpcserve_gateway_quota_sync_failures_total",
            "Quota reports the router did not answer in time",
            registry=registry,
        )
