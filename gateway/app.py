"""The OpenAI-compatible HTTP API: authenticate, validate, admit, route, relay.

Handlers are plain functions over a `Gateway` object that holds what a running
gateway owns (the routing client, the relay, the key ring, the quota gate, its
metrics). No middleware stack: per-request work is what is written here, and it
is measured (bench/proxy_overhead.py, feature by feature).

Order of checks, so that nothing is counted against a tenant's quota for a request
rejected as bad input: key (401) -> body size (413) -> body schema (400) -> allowed
model (403) -> quota (429) -> route (404/503, or overflow) -> relay (502/504, one
retry on another replica when the engine failed before its first byte).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from hpcserve.config import GatewayConfig
from hpcserve.gateway import errors, validate
from hpcserve.gateway.auth import KeyRing, Tenant
from hpcserve.gateway.batch.handlers import batch_routes
from hpcserve.gateway.batch.service import BatchService
from hpcserve.gateway.metrics import GatewayMetrics
from hpcserve.gateway.overflow import ExternalAPI
from hpcserve.gateway.quota import QuotaExceeded, QuotaGate, has_limits
from hpcserve.gateway.relay import FORWARDED_REQUEST_HEADERS, Relay, UpstreamFailed
from hpcserve.gateway.routing_client import RouterUnavailable, RoutingClient
from hpcserve.router.prompt_tokens import RouteHints

if TYPE_CHECKING:
    from hpcserve.gateway.tracing import Tracing

log = logging.getLogger(__name__)

__all__ = ["Gateway", "GatewayMetrics", "build_app"]

_json_object = msgspec.json.Decoder(dict[str, Any])
_dict = msgspec.json.Decoder(dict[str, Any])
_GENERATING = ("/v1/chat/completions", "/v1/completions")
_INCLUDE_USAGE = b',"stream_options":{"include_usage":true}}'


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        routing_endpoint: str,
        configured_models: set[str],
        metrics_registry: CollectorRegistry | None = None,
        relay: Relay | None = None,
        tracing: Tracing | None = None,
        batch: BatchService | None = None,
    ) -> None:
        self.config = config
        self.batch = batch
        self.configured_models = configured_models
        self.keys = KeyRing(config.api_keys, tenants=config.tenants, admin_keys=config.admin_keys)
        self.routing = RoutingClient(
            routing_endpoint,
            timeout_s=config.route_timeout_s,
            view_refresh_s=config.replica_view_s,
            view_max_age_s=config.replica_view_max_age_s,
        )
        self.relay = relay or Relay(upstream_timeout_s=config.upstream_timeout_s)
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.metrics = GatewayMetrics(self.metrics_registry)
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.quota = QuotaGate(self.gateway_id, stale_after_s=max(5.0, 10 * config.quota_sync_s))
        self.external = ExternalAPI(config.overflow) if config.overflow.base_url else None
        self.external_relay = (
            Relay(upstream_timeout_s=config.overflow.timeout_s) if self.external else None
        )
        if tracing is None and config.otlp_traces_endpoint:
            # Imported only when tracing is on: the OpenTelemetry SDK costs start-up time.
            from hpcserve.gateway.tracing import Tracing

            tracing = Tracing(config.otlp_traces_endpoint, sample_ratio=config.trace_sample_ratio)
        self.tracing = tracing
        # Prefix-aware routing: the prompt's block hashes for the router (set by server.py).
        self.route_hints: RouteHints | None = None
        self._quota_sync: asyncio.Task[None] | None = None
        self._children: dict[tuple[str, str], _ModelMetrics] = {}

    async def start(self) -> None:
        await self.routing.start()
        await self.relay.start()
        if self.external_relay is not None:
            await self.external_relay.start()
        if any(has_limits(t) for t in self.keys.tenants()):
            self._quota_sync = asyncio.create_task(self._sync_quotas(), name="quota-sync")
        if self.batch is not None:
            await self.batch.start(self)

    async def close(self) -> None:
        if self.batch is not None:
            await self.batch.close()
        if self._quota_sync is not None:
            self._quota_sync.cancel()
            await asyncio.gather(self._quota_sync, return_exceptions=True)
        await self.relay.close()
        if self.external_relay is not None:
            await self.external_relay.close()
        await self.routing.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    async def _sync_quotas(self) -> None:
        interval = self.config.quota_sync_s
        while True:
            await asyncio.sleep(interval)
            # Also when this gateway is idle: the others' usage must stay current here.
            usage = self.quota.report(keepalive=True) or []
            try:
                totals = await self.routing.sync_quota(self.gateway_id, usage)
            except RouterUnavailable:
                self.metrics.quota_sync_failures.inc()
                self.quota.unsent()
                continue
            except Exception:  # the sync must outlive a bad reply; limits go local meanwhile
                log.exception("quota sync failed")
                self.metrics.quota_sync_failures.inc()
                self.quota.unsent()
                continue
            self.quota.apply(totals)

    async def read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        limit = self.config.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.APIError(
                413,
                f"Request body of {declared} bytes exceeds the limit of {limit} bytes "
                "(gateway.max_body_bytes)",
                code="request_too_large",
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise errors.APIError(
                    413,
                    f"Request body exceeds the limit of {limit} bytes (gateway.max_body_bytes)",
                    code="request_too_large",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(self, request: Request) -> tuple[bytes, dict[str, Any]]:
        body = await self.read_body(request)
        try:
            return body, _json_object.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError) as err:
            raise errors.bad_request(f"Request body is not a JSON object: {err}") from None

    async def relay_to_model(self, request: Request, endpoint: str) -> Response:
        tenant = self.keys.tenant_for(request.headers.get("authorization"))
        request.scope["hpcserve.tenant"] = tenant.name
        body = await self.read_body(request)
        parsed = validate.parse(endpoint, body)
        model = parsed.model
        allowed = tenant.config.allowed_models
        if allowed and model not in allowed:
            raise errors.model_not_allowed(tenant.name, model)
        limited = has_limits(tenant)
        if limited:
            try:
                self.quota.admit(tenant)
            except QuotaExceeded as err:
                self.metrics.rejected.labels(tenant.name, err.limit).inc()
                raise
        try:
            return await self._dispatch(request, endpoint, tenant, parsed, body, limited)
        except errors.APIError as err:
            if limited:
                if err.status == 404:
                    self.quota.refund(tenant)
                else:
                    self.quota.finish(tenant, 0)
            raise

    async def _dispatch(
        self,
        request: Request,
        endpoint: str,
        tenant: Tenant,
        parsed: validate.Request,
        body: bytes,
        limited: bool,
    ) -> Response:
        model = parsed.model
        stream = parsed.stream
        strip_usage = False
        if stream and endpoint in _GENERATING:
            # Usage is what tokens/min and the token metrics count: ask for it, and hide it
            # from a client that did not.
            options = parsed.stream_options  # type: ignore[union-attr]
            if options is None:
                body = body.rstrip()[:-1] + _INCLUDE_USAGE
                strip_usage = True
            elif not options.include_usage:
                payload = _dict.decode(body)
                payload["stream_options"]["include_usage"] = True
                body = msgspec.json.encode(payload)
                strip_usage = True
        headers = {"Content-Type": "application/json"}
        for name in FORWARDED_REQUEST_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        span = None
        if self.tracing is not None:
            span = self.tracing.request_span(
                endpoint,
                model,
                request.headers,
                {
                    "gen_ai.request.max_tokens": getattr(parsed, "max_tokens", None),
                    "gen_ai.request.temperature": getattr(parsed, "temperature", None),
                    "gen_ai.request.seed": getattr(parsed, "seed", None),
                    "hpcserve.tenant": tenant.name,
                },
            )
        hints: dict[str, Any] = {}
        if self.route_hints is not None and endpoint in _GENERATING:
            payload = _dict.decode(body) if self.route_hints.covers(model) else {}
            hints = self.route_hints.hints(model, payload, request.headers)
        exclude: list[str] = []
        failure: errors.APIError | None = None
        for _attempt in range(2):
            started = time.perf_counter()
            try:
                decision = await self.routing.route(
                    model, priority=tenant.config.priority, exclude=exclude, **hints
                )
            except RouterUnavailable as err:
                log.warning("routing failed: %s", err)
                decision = None
            waited = time.perf_counter() - started
            self.metrics.queue.observe(waited)
            if span is not None:
                assert self.tracing is not None
                self.tracing.routed(span, decision.replica_id if decision else "", waited)
            if decision is None or not decision.replica_id:
                if (
                    model not in self.configured_models
                    and decision is not None
                    and not exclude
                    # A LoRA adapter that exists but could not be loaded in time is a 503.
                    and not decision.error.startswith("adapter_")
                ):
                    _end(span, 404)
                    raise errors.model_not_found(model)
                if model in self.configured_models:
                    request.scope["hpcserve.model"] = model
                if self.external is not None and self.external.takes(tenant, model):
                    request.scope["hpcserve.model"] = model  # a name from the config
                    return await self._overflow(
                        endpoint, tenant, model, body, stream, strip_usage, limited, span
                    )
                if failure is not None:
                    _end(span, failure.status)
                    raise failure
                _end(span, 503)
                raise errors.no_replica(model)
            # Only routable names become metric labels: client input must not grow the series.
            request.scope["hpcserve.model"] = model
            exchange = _Exchange(self, tenant, model, limited, decision.replica_id, stream, span)
            if span is not None:
                assert self.tracing is not None
                self.tracing.inject(span, headers)
            try:
                return await self.relay.forward(
                    decision.url + endpoint,
                    body,
                    headers,
                    stream=stream,
                    exchange=exchange,
                    strip_usage=strip_usage,
                )
            except UpstreamFailed as err:
                exchange.abandon()
                log.warning("replica %s failed before its first byte: %s", decision.replica_id, err)
                failure = err
                exclude = [*exclude, decision.replica_id]
                self.metrics.retries.labels(model).inc()
                continue
            except errors.APIError as err:
                exchange.abandon()
                _end(span, err.status)
                raise
        assert failure is not None
        _end(span, failure.status)
        raise failure

    async def _overflow(
        self,
        endpoint: str,
        tenant: Tenant,
        model: str,
        body: bytes,
        stream: bool,
        strip_usage: bool,
        limited: bool,
        span: Any,
    ) -> Response:
        assert self.external is not None and self.external_relay is not None
        self.metrics.overflow.labels(model, tenant.name).inc()
        exchange = _Exchange(self, tenant, model, limited, "", stream, span)
        try:
            return await self.external_relay.forward(
                self.external.url(endpoint),
                self.external.body(body, model),
                self.external.headers,
                stream=stream,
                exchange=exchange,
                strip_usage=strip_usage,
            )
        except errors.APIError as err:
            exchange.abandon()
            _end(span, err.status)
            raise

    def model_metrics(self, model: str, tenant: str) -> _ModelMetrics:
        key = (model, tenant)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = _ModelMetrics(self.metrics, model, tenant)
        return children


class _ModelMetrics:
    """The labelled children of one (model, tenant), looked up once, not per request."""

    __slots__ = ("tokens_in", "tokens_out", "tpot", "ttft")

    def __init__(self, metrics: GatewayMetrics, model: str, tenant: str) -> None:
        self.ttft = metrics.ttft.labels(model)
        self.tpot = metrics.tpot.labels(model)
        self.tokens_in = metrics.tokens.labels(model, tenant, "in")
        self.tokens_out = metrics.tokens.labels(model, tenant, "out")


def _end(span: Any, status: int) -> None:
    if span is not None:
        from hpcserve.gateway.tracing import Tracing  # loaded already: a span exists

        Tracing.finish(span, status, 0, 0)


class _Exchange:
    """One relayed request: what the relay reports ends up in metrics, quotas and the trace."""

    __slots__ = (
        "completion",
        "first_at",
        "gateway",
        "limited",
        "model",
        "prompt",
        "replica_id",
        "span",
        "started",
        "stream",
        "tenant",
    )

    def __init__(
        self,
        gateway: Gateway,
        tenant: Tenant,
        model: str,
        limited: bool,
        replica_id: str,
        stream: bool,
        span: Any,
    ) -> None:
        self.gateway = gateway
        self.tenant = tenant
        self.model = model
        self.limited = limited
        self.replica_id = replica_id
        self.stream = stream
        self.span = span
        self.started = time.perf_counter()
        self.first_at = 0.0
        self.prompt = 0
        self.completion = 0
        gateway.metrics.in_flight.inc()

    def first_byte(self) -> None:
        self.first_at = time.perf_counter()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt = prompt_tokens
        self.completion = completion_tokens

    def abandon(self) -> None:
        """The relay raised: release the replica; the caller settles quota and trace."""
        self.gateway.metrics.in_flight.dec()
        if self.replica_id:
            self.gateway.routing.release(self.replica_id)

    def done(self, status: int) -> None:
        gateway = self.gateway
        gateway.metrics.in_flight.dec()
        if self.replica_id:
            gateway.routing.release(self.replica_id)
        if self.limited:
            if 400 <= status < 500 and status not in (429, 499):
                gateway.quota.refund(self.tenant)  # the engine refused it as bad input
            else:
                gateway.quota.finish(self.tenant, self.prompt + self.completion)
        if self.prompt or self.completion or (self.stream and self.first_at):
            m = gateway.model_metrics(self.model, self.tenant.name)
            if self.prompt:
                m.tokens_in.inc(self.prompt)
            if self.completion:
                m.tokens_out.inc(self.completion)
            if self.stream and self.first_at:
                m.ttft.observe(self.first_at - self.started)
                if self.completion > 1:
                    per_token = (time.perf_counter() - self.first_at) / (self.completion - 1)
                    m.tpot.observe(per_token)
        if self.span is not None:
            assert gateway.tracing is not None
            gateway.tracing.finish(self.span, status, self.prompt, self.completion)


Handler = Callable[[Gateway, Request], Awaitable[Response]]


def _endpoint(
    gateway: Gateway, name: str, handler: Handler
) -> Callable[[Request], Awaitable[Response]]:
    metrics = gateway.metrics
    latency = metrics.latency.labels(name)
    # Labelled children looked up once per (model, tenant, status), not per request.
    counters: dict[tuple[str, str, int], Any] = {}

    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        try:
            response = await handler(gateway, request)
        except errors.APIError as err:
            response = err.response()
        except ClientDisconnect:
            response = Response(status_code=499)
        latency.observe(time.perf_counter() - started)
        scope = request.scope
        key = (
            scope.get("hpcserve.model", ""),
            scope.get("hpcserve.tenant", ""),
            response.status_code,
        )
        counter = counters.get(key)
        if counter is None:
            counter = counters[key] = metrics.requests.labels(name, key[0], key[1], str(key[2]))
        counter.inc()
        return response

    return endpoint


async def chat_completions(gateway: Gateway, request: Request) -> Response:
    return await gateway.relay_to_model(request, "/v1/chat/completions")


async def completions(gateway: Gateway, request: Request) -> Response:
    return await gateway.relay_to_model(request, "/v1/completions")


async def embeddings(gateway: Gateway, request: Request) -> Response:
    return await gateway.relay_to_model(request, "/v1/embeddings")


async def rerank(gateway: Gateway, request: Request) -> Response:
    return await gateway.relay_to_model(request, "/v1/rerank")


async def score(gateway: Gateway, request: Request) -> Response:
    return await gateway.relay_to_model(request, "/v1/score")


async def list_models(gateway: Gateway, request: Request) -> Response:
    gateway.keys.tenant_for(request.headers.get("authorization"))
    try:
        listing = await gateway.routing.models()
    except RouterUnavailable as err:
        raise errors.APIError(503, str(err), type="service_unavailable", retry_after_s=5) from None
    data = [
        {
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": "hpcserve",
            "replicas": m.replicas,
            # A LoRA adapter names its base model, as vLLM's own /v1/models does.
            **({"parent": m.parent} if m.parent else {}),
        }
        for m in listing.models
    ]
    return JSONResponse({"object": "list", "data": data})


async def health(gateway: Gateway, request: Request) -> Response:
    return PlainTextResponse("ok")


async def metrics(gateway: Gateway, request: Request) -> Response:
    return Response(generate_latest(gateway.metrics_registry), media_type=CONTENT_TYPE_LATEST)


def build_app(gateway: Gateway) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        await gateway.start()
        log.info(
            "gateway ready: %d api keys, models configured: %s",
            len(gateway.keys),
            ", ".join(sorted(gateway.configured_models)) or "none",
        )
        yield
        await gateway.close()

    routes = [
        Route(
            "/v1/chat/completions", _endpoint(gateway, "chat", chat_completions), methods=["POST"]
        ),
        Route("/v1/completions", _endpoint(gateway, "completions", completions), methods=["POST"]),
        Route("/v1/embeddings", _endpoint(gateway, "embeddings", embeddings), methods=["POST"]),
        # vLLM serves rerank and score with and without the /v1 prefix (Cohere/Jina style).
        Route("/v1/rerank", _endpoint(gateway, "rerank", rerank), methods=["POST"]),
        Route("/rerank", _endpoint(gateway, "rerank", rerank), methods=["POST"]),
        Route("/v1/score", _endpoint(gateway, "score", score), methods=["POST"]),
        Route("/score", _endpoint(gateway, "score", score), methods=["POST"]),
        Route("/v1/models", _endpoint(gateway, "models", list_models), methods=["GET"]),
        Route("/health", _endpoint(gateway, "health", health), methods=["GET"]),
        Route("/metrics", _endpoint(gateway, "metrics", metrics), methods=["GET"]),
        *(batch_routes(gateway, _endpoint) if gateway.batch is not None else []),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed},
    )


async def _not_found(request: Request, exc: Exception) -> Response:
    return errors.APIError(
        404, f"No such endpoint: {request.url.path}", code="unknown_endpoint"
    ).response()


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return errors.APIError(
        405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"
    ).response()
