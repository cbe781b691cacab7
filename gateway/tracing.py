"""OpenTelemetry spans for relayed requests, with the GenAI semantic-convention attributes.

Off unless `gateway.otlp_traces_endpoint` is set: the gateway then holds no Tracing
object and the request path only tests `is None`. When on, each request gets a span
"{operation} {model}" (kind CLIENT, parent: the client's traceparent, if any) carrying the
routing decision as attributes (`hpcserve.replica`, `hpcserve.route_ms`), and the span's
traceparent goes on to vLLM, whose own spans (vLLM's --otlp-traces-endpoint) then join the
same trace. `gateway.trace_sample_ratio` samples by trace id, parent-based: a client's
traceparent is always followed, sampled or not (as the SDK's ParentBased(TraceIdRatioBased)).

The request path records a span as a small object (ids, times, attributes: a few
microseconds); a background thread turns finished spans into the SDK's ReadableSpan and
hands them to the exporter (OTLP over HTTP) in batches. An SDK span per request cost ~45 us
of the event loop's time here (docs/benchmarks.md). At most `MAX_QUEUED` finished spans
wait for export; beyond that the oldest are dropped rather than growing memory.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

log = logging.getLogger(__name__)

OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/v1/score": "score",
}
MAX_QUEUED = 8192
EXPORT_BATCH = 512
EXPORT_EVERY_S = 0.5
_HEX = frozenset("0123456789abcdef")
_TRACE_ID_LIMIT = (1 << 64) - 1  # TraceIdRatioBased looks at the low 64 bits
_SCOPE = InstrumentationScope("hpcserve.gateway")


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent; None if absent or invalid."""
    if not value:
        return None
    value = value.strip()
    parts = value.split("-")
    if len(parts) < 4:
        return None
    version, trace_hex, span_hex, flags = parts[0], parts[1], parts[2], parts[3]
    if (
        len(version) != 2
        or version == "ff"
        or (version == "00" and len(parts) != 4)
        or len(trace_hex) != 32
        or len(span_hex) != 16
        or len(flags) != 2
        or not _HEX.issuperset(version + trace_hex + span_hex + flags)
    ):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


class RequestSpan:
    """One request's span as recorded on the event loop; exported later, off the loop."""

    __slots__ = (
        "attributes",
        "end_ns",
        "name",
        "parent_span_id",
        "sampled",
        "sink",
        "span_id",
        "start_ns",
        "status",
        "trace_id",
    )

    def __init__(
        self,
        sink: Tracing,
        name: str,
        trace_id: int,
        parent_span_id: int,
        sampled: bool,
        attributes: dict[str, Any],
    ) -> None:
        self.sink = sink
        self.name = name
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64) or 1
        self.parent_span_id = parent_span_id
        self.sampled = sampled
        self.attributes = attributes
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.status = 0

    def is_recording(self) -> bool:
        return self.sampled and not self.end_ns

    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"


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
        self.exporter = exporter
        self.resource = Resource.create({"service.name": "hpcserve"})
        self._bound = round(sample_ratio * (_TRACE_ID_LIMIT + 1))
        self._finished: collections.deque[RequestSpan] = collections.deque(maxlen=MAX_QUEUED)
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._export_loop, name="trace-export", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporter."""
        self._stopping = True
        self._wake.set()
        self._thread.join(30)
        self.exporter.shutdown()

    def request_span(
        self, endpoint: str, model: str, headers: Mapping[str, str], attributes: dict[str, object]
    ) -> RequestSpan:
        operation = OPERATIONS.get(endpoint, endpoint)
        parent = parse_traceparent(headers.get("traceparent"))
        if parent is not None:
            trace_id, parent_span_id, sampled = parent
        else:
            trace_id, parent_span_id = random.getrandbits(128) or 1, 0
            sampled = (trace_id & _TRACE_ID_LIMIT) < self._bound
        attrs: dict[str, Any] = {}
        if sampled:
            attrs["gen_ai.operation.name"] = operation
            attrs["gen_ai.provider.name"] = "vllm"
            attrs["gen_ai.request.model"] = model
            for name, value in attributes.items():
                if value is not None:
                    attrs[name] = value
        return RequestSpan(self, f"{operation} {model}", trace_id, parent_span_id, sampled, attrs)

    @staticmethod
    def routed(span: RequestSpan, replica_id: str, seconds: float) -> None:
        if span.sampled:
            span.attributes["hpcserve.replica"] = replica_id
            span.attributes["hpcserve.route_ms"] = round(seconds * 1000, 3)

    @staticmethod
    def inject(span: RequestSpan, headers: dict[str, str]) -> None:
        headers["traceparent"] = span.traceparent()

    @staticmethod
    def finish(span: RequestSpan, status: int, prompt_tokens: int, completion_tokens: int) -> None:
        if span.end_ns:
            return
        span.end_ns = time.time_ns()
        if not span.sampled:
            return
        attrs = span.attributes
        attrs["http.response.status_code"] = status
        if prompt_tokens:
            attrs["gen_ai.usage.input_tokens"] = prompt_tokens
        if completion_tokens:
            attrs["gen_ai.usage.output_tokens"] = completion_tokens
        span.status = status
        sink = span.sink
        sink._finished.append(span)
        if len(sink._finished) >= EXPORT_BATCH:
            sink._wake.set()

    # -- the export thread --------------------------------------------------------------

    def _export_loop(self) -> None:
        while True:
            self._wake.wait(EXPORT_EVERY_S)
            self._wake.clear()
            stopping = self._stopping
            while self._finished:
                batch: list[ReadableSpan] = []
                while self._finished and len(batch) < EXPORT_BATCH:
                    batch.append(self._readable(self._finished.popleft()))
                try:
                    self.exporter.export(batch)
                except Exception:  # an exporter must not take the gateway down
                    log.exception("trace export failed; %d spans dropped", len(batch))
            if stopping:
                return

    def _readable(self, span: RequestSpan) -> ReadableSpan:
        flags = TraceFlags(TraceFlags.SAMPLED)
        parent = (
            SpanContext(span.trace_id, span.parent_span_id, is_remote=True, trace_flags=flags)
            if span.parent_span_id
            else None
        )
        return ReadableSpan(
            span.name,
            context=SpanContext(span.trace_id, span.span_id, is_remote=False, trace_flags=flags),
            parent=parent,
            resource=self.resource,
            attributes=span.attributes,
            kind=SpanKind.CLIENT,
            instrumentation_scope=_SCOPE,
            status=Status(StatusCode.ERROR) if span.status >= 400 else Status(StatusCode.UNSET),
            start_time=span.start_ns,
            end_time=span.end_ns,
        )
