"""The OpenAI-compatible HTTP API: authenticate, validate, ask the router, relay.

Handlers are plain functions over a `Gateway` object that holds what a running
gateway owns (the routing client, the relay, the key ring, its metrics). No
middleware stack: per-request work is what is written here, and it is measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from hpcserve.config import GatewayConfig
from hpcserve.gateway import errors
from hpcserve.gateway.auth import KeyRing
from hpcserve.gateway.relay import Relay
from hpcserve.gateway.routing_client import RouterUnavailable, RoutingClient

log = logging.getLogger(__name__)

_json_object = msgspec.json.Decoder(dict[str, Any])


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "hpcserve_gateway_requests_total",
            "Requests by endpoint, model and status",
            ["endpoint", "model", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "hpcserve_gateway_request_seconds",
            "Time to the response head (first byte for streams) by endpoint",
            ["endpoint"],
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.in_flight = Gauge(
            "hpcserve_gateway_in_flight", "Requests being relayed to engines", registry=registry
        )


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        routing_endpoint: str,
        configured_models: set[str],
        metrics_registry: CollectorRegistry | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.config = config
        self.configured_models = configured_models
        self.keys = KeyRing(config.api_keys, tenants=config.tenants, admin_keys=config.admin_keys)
        self.routing = RoutingClient(routing_endpoint, timeout_s=config.route_timeout_s)
        self.relay = relay or Relay(upstream_timeout_s=config.upstream_timeout_s)
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.metrics = GatewayMetrics(self.metrics_registry)

    async def start(self) -> None:
        await self.routing.start()
        await self.relay.start()

    async def close(self) -> None:
        await self.relay.close()
        await self.routing.close()

    async def read_json(self, request: Request) -> tuple[bytes, dict[str, Any]]:
        declared = request.headers.get("content-length")
        limit = self.config.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.APIError(
                413,
                f"Request body of {declared} bytes exceeds the limit of {limit} bytes",
                code="request_too_large",
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise errors.APIError(
                    413,
                    f"Request body exceeds the limit of {limit} bytes",
                    code="request_too_large",
                )
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            return body, _json_object.decode(body)
        except msgspec.DecodeError as err:
            raise errors.bad_request(f"Request body is not a JSON object: {err}") from None

    async def relay_to_model(self, request: Request, endpoint: str) -> Response:
        self.keys.tenant_for(request.headers.get("authorization"))
        body, payload = await self.read_json(request)
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise errors.bad_request("'model' is required and must be a string", param="model")
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise errors.bad_request("'stream' must be a boolean", param="stream")
        try:
            decision = await self.routing.route(model)
        except RouterUnavailable as err:
            log.warning("routing failed: %s", err)
            raise errors.no_replica(model) from None
        if not decision.replica_id:
            if model not in self.configured_models:
                raise errors.model_not_found(model)
            request.scope["hpcserve.model"] = model
            raise errors.no_replica(model)
        # Only routable names become metric labels: client input must not grow the series.
        request.scope["hpcserve.model"] = model
        self.metrics.in_flight.inc()

        def finished() -> None:
            self.metrics.in_flight.dec()
            self.routing.release(decision.replica_id)

        return await self.relay.forward(
            decision.url + endpoint,
            body,
            dict(request.headers),
            stream=stream,
            on_done=finished,
        )


Handler = Callable[[Gateway, Request], Awaitable[Response]]


def _endpoint(
    gateway: Gateway, name: str, handler: Handler
) -> Callable[[Request], Awaitable[Response]]:
    metrics = gateway.metrics

    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        try:
            response = await handler(gateway, request)
        except errors.APIError as err:
            response = err.response()
        except ClientDisconnect:
            response = Response(status_code=499)
        metrics.latency.labels(name).observe(time.perf_counter() - started)
        metrics.requests.labels(
            name, request.scope.get("hpcserve.model", ""), str(response.status_code)
        ).inc()
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
