"""Tracing: GenAI attributes on the request span, sampling, the traceparent sent on."""

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
