"""The gateway's own CPU per request, feature by feature, in process (no sockets).

bench/proxy_overhead.py measures whole requests through real sockets, where uvicorn and the
relay client dominate and a loaded machine blurs small differences. This measures only what
each feature's code does for one request, many times over, as CPU time of the process
(background threads included), and sets the ways replaced beside the ones in use:

  auth      KeyRing.tenant_for (sha256 of the key, one dict lookup)
  validate  validate.parse of the ~1.3 KB chat body of the proxy benchmark
  quotas    QuotaGate.admit + finish for a tenant with every limit
  metrics   what one streamed request records: prometheus_client's own metrics (a lock and a
            label lookup per call) against gateway/metrics.py (plain numbers + a Collector)
  tracing   one request span with its attributes, traceparent injected, exported to an
            exporter that drops it: the OpenTelemetry SDK's span + BatchSpanProcessor against
            gateway/tracing.py (a small record, SDK spans built by the export thread)

    .venv/bin/python bench/gateway_feature_cpu.py [--requests 20000] [--rounds 3]

Prints a markdown table and writes bench/results/gateway_feature_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from bench.proxy_overhead import CHAT_BODY, KEY  # noqa: E402
from bench.results import write_results  # noqa: E402
from hpcserve.config import ApiKey, TenantConfig, hash_api_key  # noqa: E402
from hpcserve.gateway import validate  # noqa: E402
from hpcserve.gateway.auth import KeyRing  # noqa: E402
from hpcserve.gateway.metrics import GatewayMetrics  # noqa: E402
from hpcserve.gateway.quota import QuotaGate  # noqa: E402
from hpcserve.gateway.tracing import Tracing  # noqa: E402

ATTRIBUTES = {
    "gen_ai.request.max_tokens": 64,
    "gen_ai.request.temperature": None,
    "gen_ai.request.seed": None,
    "hpcserve.tenant": "bench",
}


class DropSpans(SpanExporter):
    def export(self, spans):  # type: ignore[no-untyped-def]
        return SpanExportResult.SUCCESS


def prometheus_client_metrics() -> Callable[[], None]:
    """The gateway's metrics as prometheus_client objects, children bound once (as before)."""
    registry = CollectorRegistry()
    requests = Counter("r", "", ["endpoint", "model", "tenant", "status"], registry=registry)
    latency = Histogram("l", "", ["endpoint"], registry=registry)
    in_flight = Gauge("f", "", registry=registry)
    ttft = Histogram("t", "", ["model"], registry=registry)
    tpot = Histogram("p", "", ["model"], registry=registry)
    tokens = Counter("k", "", ["model", "tenant", "direction"], registry=registry)
    queue = Histogram("q", "", registry=registry)
    return _one_stream(requests, latency, in_flight, ttft, tpot, tokens, queue)


def plain_metrics() -> Callable[[], None]:
    m = GatewayMetrics(CollectorRegistry())
    return _one_stream(m.requests, m.latency, m.in_flight, m.ttft, m.tpot, m.tokens, m.queue)


def _one_stream(requests, latency, in_flight, ttft, tpot, tokens, queue):  # type: ignore[no-untyped-def]
    req = requests.labels("chat", "m", "bench", "200")
    lat = latency.labels("chat")
    first, per_token = ttft.labels("m"), tpot.labels("m")
    tokens_in, tokens_out = tokens.labels("m", "bench", "in"), tokens.labels("m", "bench", "out")

    def record() -> None:
        in_flight.inc()
        queue.observe(0.0003)
        lat.observe(0.002)
        in_flight.dec()
        tokens_in.inc(300)
        tokens_out.inc(20)
        first.observe(0.02)
        per_token.observe(0.01)
        req.inc()

    return record


def sdk_tracing() -> tuple[Callable[[], None], Callable[[], None]]:
    """One SDK span per request, as the gateway did before (kept here to compare)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(
        resource=Resource.create({"service.name": "hpcserve"}),
        sampler=ParentBased(TraceIdRatioBased(1.0)),
    )
    provider.add_span_processor(BatchSpanProcessor(DropSpans()))
    tracer = provider.get_tracer("hpcserve.gateway")
    propagator = TraceContextTextMapPropagator()

    def one() -> None:
        span = tracer.start_span(
            "chat m",
            context=propagator.extract({}),
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": "vllm",
                "gen_ai.request.model": "m",
                **{k: v for k, v in ATTRIBUTES.items() if v is not None},
            },
        )
        span.set_attribute("hpcserve.replica", "r")
        span.set_attribute("hpcserve.route_ms", 0.3)
        propagator.inject({}, context=trace.set_span_in_context(span))
        span.set_attribute("http.response.status_code", 200)
        span.set_attribute("gen_ai.usage.input_tokens", 300)
        span.set_attribute("gen_ai.usage.output_tokens", 20)
        span.end()

    return one, provider.shutdown


def our_tracing() -> tuple[Callable[[], None], Callable[[], None]]:
    tracing = Tracing(exporter=DropSpans())

    def one() -> None:
        span = tracing.request_span("/v1/chat/completions", "m", {}, ATTRIBUTES)
        Tracing.routed(span, "r", 0.0003)
        tracing.inject(span, {})
        Tracing.finish(span, 200, 300, 20)

    return one, tracing.shutdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.requests
    tenant_config = TenantConfig(
        name="bench", requests_per_min=10**9, tokens_per_min=10**12, max_concurrent=10**6
    )
    keys = KeyRing([ApiKey(tenant="bench", sha256=hash_api_key(KEY))], tenants=[tenant_config])
    tenant = keys.tenant_for(f"Bearer {KEY}")
    quota = QuotaGate("bench")

    def admit_finish() -> None:
        quota.admit(tenant)
        quota.finish(tenant, 320)

    cases: list[tuple[str, str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]]] = [
        ("auth", "KeyRing.tenant_for", lambda: (lambda: keys.tenant_for(f"Bearer {KEY}"), _no)),
        (
            "validate",
            "validate.parse",
            lambda: (lambda: validate.parse("/v1/chat/completions", CHAT_BODY), _no),
        ),
        ("quotas", "QuotaGate.admit + finish", lambda: (admit_finish, _no)),
        ("metrics", "prometheus_client", lambda: (prometheus_client_metrics(), _no)),
        ("metrics", "plain numbers + Collector (in use)", lambda: (plain_metrics(), _no)),
        ("tracing", "OpenTelemetry SDK span", sdk_tracing),
        ("tracing", "recorded, exported by a thread (in use)", our_tracing),
    ]
    load_before = os.getloadavg()
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for feature, how, make in cases:
            one, stop = make()
            started = time.process_time()
            for _ in range(n):
                one()
            stop()  # an export thread's work is counted too
            used = time.process_time() - started
            results.setdefault((feature, how), []).append(used / n * 1e6)
    load_after = os.getloadavg()
    print(
        f"load average before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in load_after)}; {n} requests, medians of {args.rounds}\n"
    )
    print("| feature | how | CPU per request |")
    print("|---|---|---|")
    rows = []
    for (feature, how), values in results.items():
        us = statistics.median(values)
        print(f"| {feature} | {how} | {us:.1f} us |")
        rows.append({"feature": feature, "how": how, "cpu_us": us})
    write_results(
        "gateway_feature_cpu",
        {"rows": rows},
        {"load_before": load_before, "load_after": load_after},
    )


def _no() -> None:
    pass


if __name__ == "__main__":
    main()
