"""OpenTelemetry spans for relayed requests, with the GenAI semantic-convention attributes.

Off unless `gateway.otlp_traces_endpoint` is set: the gateway then holds no Tracing
object and the request path only tests `is None`. When on, each request gets a span
"{operation} {model}" (kind CLIENT, parent: the client's traceparent, if any) carrying the
routing decision as attributes (`hpcserve.replica`, `hpcserve.route_ms`: a child span per
request doubled the cost), and the span's traceparent goes on to vLLM, whose own spans
(vLLM's --otlp-traces-endpoint) then join the same trace. `gateway.trace_sample_ratio`
samples by trace id, parent-based: a client's sampled traceparent is always followed.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/score": "score",
}
_propagator = TraceContextTextMapPropagator()


class Tracing:
    def __init__(
        self,
        endpoint: str = "",
        *,
        sample_ratio: float = 1.0,
        exporter: SpanExporter | None = None,
    ) -> None:
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "hpcserve"}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("hpcserve.gateway")

    def shutdown(self) -> None:
        self.provider.shutdown()

    def request_span(
        self, endpoint: str, model: str, headers: Mapping[str, str], attributes: dict[str, object]
    ) -> Span:
        operation = OPERATIONS.get(endpoint, endpoint)
        parent = _propagator.extract(headers)
        span = self.tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "vllm",
                "gen_ai.request.model": model,
                **{k: v for k, v in attributes.items() if v is not None},
            },
        )
        return span

    @staticmethod
    def routed(span: Span, replica_id: str, seconds: float) -> None:
        if span.is_recording():
            span.set_attribute("hpcserve.replica", replica_id)
            span.set_attribute("hpcserve.route_ms", round(seconds * 1000, 3))

    @staticmethod
    def inject(span: Span, headers: dict[str, str]) -> None:
        _propagator.inject(headers, context=trace.set_span_in_context(span))

    @staticmethod
    def finish(span: Span, status: int, prompt_tokens: int, completion_tokens: int) -> None:
        if not span.is_recording():
            span.end()
            return
        span.set_attribute("http.response.status_code", status)
        if prompt_tokens:
            span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        if completion_tokens:
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if status >= 400:
            span.set_status(StatusCode.ERROR)
        span.end()
