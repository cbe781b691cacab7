"""Tracing: GenAI attributes on the request span, sampling, the traceparent sent on."""

import http.server
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hpcserve.gateway.tracing import Tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_sampled_request_span_and_the_traceparent_for_the_engine() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(sample_ratio=0.0, exporter=exporter)
    # Sampled by the client: followed even at ratio 0.
    span = tracing.request_span("/v1/completions", "m", {"traceparent": PARENT}, {"x": None})
    Tracing.routed(span, "r1", 0.0012)
    headers: dict[str, str] = {}
    tracing.inject(span, headers)
    Tracing.finish(span, 200, 7, 3)
    # Not sampled by anyone: a non-recording span, nothing exported, nothing set.
    quiet = tracing.request_span("/v1/completions", "m", {}, {})
    Tracing.finish(quiet, 200, 7, 3)
    tracing.shutdown()
    (done,) = exporter.get_finished_spans()
    assert done.name == "text_completion m"
    assert done.attributes is not None and "x" not in done.attributes
    assert done.attributes["gen_ai.usage.input_tokens"] == 7
    assert done.attributes["hpcserve.route_ms"] == 1.2
    trace_id, span_id = f"{done.context.trace_id:032x}", f"{done.context.span_id:016x}"
    assert headers["traceparent"] == f"00-{trace_id}-{span_id}-01"
    assert trace_id == PARENT.split("-")[1]
    assert not quiet.is_recording()


def test_the_clients_traceparent_decides_sampling_and_bad_ones_start_a_new_trace() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(sample_ratio=1.0, exporter=exporter)
    unsampled = PARENT[:-2] + "00"
    quiet = tracing.request_span("/v1/chat/completions", "m", {"traceparent": unsampled}, {})
    headers: dict[str, str] = {}
    tracing.inject(quiet, headers)
    assert not quiet.is_recording()
    assert headers["traceparent"].startswith(PARENT[:36]) and headers["traceparent"][-2:] == "00"
    Tracing.finish(quiet, 200, 1, 1)
    for bad in (
        "00-xyz",
        "ff" + PARENT[2:],
        PARENT.replace("0af7", "0AF7"),
        "00-" + "0" * 32 + PARENT[35:],
    ):
        span = tracing.request_span("/v1/chat/completions", "m", {"traceparent": bad}, {})
        assert span.is_recording() and f"{span.trace_id:032x}" != PARENT.split("-")[1]
        Tracing.finish(span, 503, 0, 0)
    tracing.shutdown()
    spans = exporter.get_finished_spans()
    assert len(spans) == 4 and all(s.parent is None for s in spans)
    assert all(
        not s.status.is_ok and s.attributes["http.response.status_code"] == 503 for s in spans
    )


def test_spans_reach_an_otlp_http_endpoint() -> None:
    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tracing = Tracing(f"http://127.0.0.1:{server.server_port}/v1/traces")
        span = tracing.request_span("/v1/embeddings", "e", {}, {"hpcserve.tenant": "t"})
        Tracing.finish(span, 200, 5, 0)
        tracing.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    request = ExportTraceServiceRequest.FromString(b"".join(received))
    (exported,) = request.resource_spans[0].scope_spans[0].spans
    assert exported.name == "embeddings e"
    attributes = {a.key: a.value for a in exported.attributes}
    assert attributes["hpcserve.tenant"].string_value == "t"
    assert attributes["gen_ai.usage.input_tokens"].int_value == 5
