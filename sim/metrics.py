"""The simulated engine's /metrics: vLLM's own series names, labels and buckets.

Names, label names (``model_name``, ``engine``) and histogram buckets are those of vLLM
0.32's Prometheus logger (vllm/v1/metrics/loggers.py, buckets.py); counters get prometheus
client's ``_total`` suffix there as here. Only the series hpcserve and common dashboards
read are kept; each engine has its own registry, so many simulated replicas can share a
process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hpcserve.sim.scheduler import SimRequest

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's NIXL connector's (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py).
XFER_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
XFER_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))


class SimMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, "0")
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        def counters(name: str, doc: str, label: str, keys: tuple[str, ...]) -> dict[str, Counter]:
            """One counter for each of `keys`, the value of one more label."""
            family = Counter(name, doc, [*labels, label], registry=r)
            return {k: family.labels(*values, k) for k in keys}

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.prompt_by_source = counters(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            PROMPT_SOURCES,
        )
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        # The modelled KV transfers of a decode replica (sim/transfer.py), under the names
        # vLLM's NIXL connector exports.
        self.xfer_time = histogram(
            "vllm:nixl_xfer_time_seconds", "KV-cache transfer duration.", XFER_TIME_BUCKETS
        )
        self.xfer_bytes = histogram(
            "vllm:nixl_bytes_transferred", "Bytes per KV-cache transfer.", XFER_BYTES_BUCKETS
        )
        self.success = counters(
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            FINISH_REASONS,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Time per output token.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time in the WAITING phase.", LATENCY_BUCKETS
        )
        self._queries_seen = 0
        self._hits_seen = 0

    def observe_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def observe_cache(self, queries: int, hits: int) -> None:
        """Counters follow the KV cache's cumulative totals."""
        self.prefix_queries.inc(queries - self._queries_seen)
        self.prefix_hits.inc(hits - self._hits_seen)
        self._queries_seen, self._hits_seen = queries, hits

    def observe_prompt(self, req: SimRequest) -> None:
        """A prompt, once computed (at its first token, as vLLM counts it), by source."""
        total = len(req.prompt_ids)
        external = req.external_tokens
        local = min(req.cached_tokens, total - external)
        self.prompt_by_source["external_kv_transfer"].inc(external)
        self.prompt_by_source["local_cache_hit"].inc(local)
        self.prompt_by_source["local_compute"].inc(total - external - local)
        self.prompt_cached.inc(external + local)

    def observe_transfer(self, seconds: float, nbytes: float) -> None:
        self.xfer_time.observe(seconds)
        self.xfer_bytes.observe(nbytes)

    def observe_finished(self, req: SimRequest) -> None:
        self.success.get(req.finish_reason, self.success["stop"]).inc()
        if req.finish_reason == "abort" or req.first_token_s < 0:
            return
        self.ttft.observe(req.first_token_s - req.arrival_s)
        self.e2e.observe(req.finished_s - req.arrival_s)
        self.queue_time.observe(max(req.scheduled_s - req.arrival_s, 0.0))
        if len(req.output_ids) > 1:
            self.tpot.observe((req.finished_s - req.first_token_s) / (len(req.output_ids) - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)
