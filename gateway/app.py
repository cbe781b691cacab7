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
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from hpcserve.config import GatewayConfig
from hpcserve.contracts.cache_salt import salt_member, salted_body, tenant_salt
from hpcserve.contracts.engine_token import bearer_matches
from hpcserve.contracts.json_members import with_members
from hpcserve.contracts.prompt_tokens import SESSION_HEADER, RouteHints
from hpcserve.contracts.protocol import OVER_QUEUE_BUDGET, RouteReply
from hpcserve.contracts.usage import UsageRecord
from hpcserve.contracts.zmtp_curve import ClientKeys
from hpcserve.gateway import disagg, errors, json_limits, model_tools, quality, validate
from hpcserve.gateway.audit import AuditLog, AuditRecord, utc_time
from hpcserve.gateway.auth import KeyRing, Tenant
from hpcserve.gateway.batch.handlers import batch_routes
from hpcserve.gateway.batch.priority import ENGINE_PRIORITY, PRIORITY_HEADER
from hpcserve.gateway.batch.service import BatchService
from hpcserve.gateway.http_protocol import CONNECTION_LOST, ConnectionLoss
from hpcserve.gateway.messages import messages_routes
from hpcserve.gateway.metrics import GatewayMetrics
from hpcserve.gateway.overflow import ExternalAPI
from hpcserve.gateway.quota import QuotaExceeded, QuotaGate, has_limits, keep_quota_synced
from hpcserve.gateway.relay import FORWARDED_REQUEST_HEADERS, Relay, UpstreamFailed
from hpcserve.gateway.request_ids import new_request_id
from hpcserve.gateway.responses import responses_routes
from hpcserve.gateway.route_hints import body_hints, body_plan
from hpcserve.gateway.routing_client import RouterUnavailable, Routing, RoutingClient
from hpcserve.gateway.usage_log import UsageLog
from hpcserve.gateway.workers import LOCAL_HEADER, WorkerSet

if TYPE_CHECKING:
    from hpcserve.gateway.tracing import Tracing

log = logging.getLogger(__name__)

__all__ = ["Gateway", "GatewayMetrics", "build_app"]

_json_object = msgspec.json.Decoder(dict[str, Any])
_dict = msgspec.json.Decoder(dict[str, Any])
_GENERATING = ("/v1/chat/completions", "/v1/completions")
_INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'
# Prefix hints: what the prompt cache leaves to render and tokenize, up to this many
# characters, is done on the event loop (a thread hand-off costs more than it does); more on
# HINT_THREADS threads, at most MAX_HINTS_WAITING; a body over HINT_DECODE_INLINE_BYTES is
# scanned and decoded there too.
INLINE_HINT_BYTES = 2048
HINT_DECODE_INLINE_BYTES = 256 * 1024
HINT_THREADS = 2
MAX_HINTS_WAITING = 64
_INCLUDE_CONTINUOUS = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
_INCLUDE_USAGE_LAST = _INCLUDE_USAGE + b"}"
# A request held for a pool at zero asks the router again this often.
WAKE_POLL_S = 0.25
# How often a request for a version no known pool at zero serves may re-read the registry.
WAKE_VERSIONS_REREAD_S = 10.0


def wake_retry_after(budget_s: float) -> int:
    """Retry-After of a 503 for a model whose pool is waking: its hold budget, at least 5 s
    (a client that waits that long is held again, and serves once the pool is up)."""
    return max(5, math.ceil(budget_s))


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        routing_endpoint: str,
        routing_keys: ClientKeys | None = None,
        routing: Routing | None = None,
        configured_models: set[str],
        metrics_registry: CollectorRegistry | None = None,
        relay: Relay | None = None,
        tracing: Tracing | None = None,
        batch: BatchService | None = None,
        engine_token: str = "",
        metrics_token: str = "",
    ) -> None:
        """engine_token: the deployment's engine token (contracts/engine_token.py), which
        every request to an engine presents; engines refuse requests without it.
        metrics_token: what /metrics (tenant names and usage) asks for as a bearer token;
        empty: /metrics is open (tests that build the app alone). routing: the router in this
        process (gateway/embedded_router.py); by default a RoutingClient of
        routing_endpoint."""
        self.config = config
        self.batch = batch
        self.configured_models = configured_models
        self.metrics_token = metrics_token.encode()
        self.keys = KeyRing(
            config.api_keys,
            tenants=config.tenants,
            admin_keys=config.admin_keys,
            on_failure=self._auth_failed,
        )
        self.routing: Routing = routing or RoutingClient(
            routing_endpoint,
            timeout_s=config.route_timeout_s,
            view_refresh_s=config.replica_view_s,
            view_max_age_s=config.replica_view_max_age_s,
            curve=routing_keys,
        )
        self.relay = relay or Relay(
            upstream_timeout_s=config.upstream_timeout_s, engine_token=engine_token
        )
        self.metrics_registry = metrics_registry or CollectorRegistry()
        self.metrics = GatewayMetrics(self.metrics_registry)
        self.audit = AuditLog(config.audit_log, on_failure=self.metrics.audit_failures.inc)
        # Usage records (contracts/usage.py), for `hpcserve report`; server.py sets the
        # directory (default <state_dir>/usage), a bare GatewayConfig has none.
        self.usage = (
            UsageLog(config.usage_dir, "gateway", on_failure=self.metrics.usage_failures.inc)
            if config.usage_dir
            else None
        )
        self._auth_report_at = 0.0  # refused keys are logged at most every AUTH_LOG_EVERY_S
        self._auth_unreported = 0
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.quota = QuotaGate(self.gateway_id, stale_after_s=max(5.0, 10 * config.quota_sync_s))
        self.external = ExternalAPI(config.overflow) if config.overflow.base_url else None
        self.external_relay = (
            Relay(
                upstream_timeout_s=config.overflow.timeout_s,
                timeout_setting="gateway.overflow.timeout_s",
                engines=False,
            )
            if self.external
            else None
        )
        if tracing is None and config.otlp_traces_endpoint:
            # Imported only when tracing is on: the OpenTelemetry SDK costs start-up time.
            from hpcserve.gateway.tracing import Tracing

            tracing = Tracing(config.otlp_traces_endpoint, sample_ratio=config.trace_sample_ratio)
        self.tracing = tracing
        # Prefix-aware routing: the prompt's block hashes for the router (set by server.py).
        self.route_hints: RouteHints | None = None
        # Models whose pools set messages_api = false (gateway/messages.py; set by server.py).
        self.messages_refused: set[str] = set()
        # Models of pools that scale to zero -> how long a request for one with no replica is
        # held while the pool wakes (pools[].autoscale.wake_budget_s; set by server.py).
        self.wake_budgets: dict[str, float] = {}
        # Registry version (name@version) -> the served name of the pool at zero serving it:
        # a request for an alias or adapter of it is held too (set by server.py).
        self.wake_versions: dict[str, str] = {}
        # Reads that map again (from the model registry), when a version asked for is not in
        # it: at most every WAKE_VERSIONS_REREAD_S (set by server.py).
        self.wake_versions_source: Callable[[], dict[str, str]] | None = None
        self._wake_versions_read_at = time.monotonic()
        # One of several worker processes on this port (set by server.py; gateway/workers.py).
        self.workers: WorkerSet | None = None
        self._hint_pool: ThreadPoolExecutor | None = None
        self._hints_waiting = 0
        self._quota_sync: asyncio.Task[None] | None = None
        self._children: dict[tuple[str, str], _ModelMetrics] = {}
        self._deployments: dict[tuple[str, str, str], quality.DeploymentMetrics] = {}

    async def start(self) -> None:
        await self.routing.start()
        await self.relay.start()
        if self.external_relay is not None:
            await self.external_relay.start()
        # Batch tokens too: the runner that takes the batches over (lock.py) sees this usage.
        if any(has_limits(t) or t.config.batch_tokens_per_min for t in self.keys.tenants()):
            self._quota_sync = asyncio.create_task(
                keep_quota_synced(
                    self.quota,
                    self.routing,
                    self.gateway_id,
                    self.config.quota_sync_s,
                    self.metrics.quota_sync_failures,
                ),
                name="quota-sync",
            )
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
        self.audit.close()
        if self.usage is not None:
            self.usage.close()
        if self.tracing is not None:
            self.tracing.shutdown()
        if self._hint_pool is not None:
            self._hint_pool.shutdown(wait=False, cancel_futures=True)

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
        json_limits.check_body(body)
        try:
            return body, _json_object.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError) as err:
            raise errors.bad_request(f"Request body is not a JSON object: {err}") from None

    async def relay_to_model(self, request: Request, endpoint: str) -> Response:
        tenant = self.keys.tenant_for(request.headers.get("authorization"))
        request.scope["hpcserve.tenant"] = tenant.name
        request.scope["hpcserve.key"] = tenant
        body = await self.read_body(request)
        parsed = validate.parse(endpoint, body)
        return await self.relay_parsed(request, endpoint, tenant, parsed, body)

    async def relay_parsed(
        self,
        request: Request,
        endpoint: str,
        tenant: Tenant,
        parsed: validate.Request,
        body: bytes,
    ) -> Response:
        """A checked body from an authenticated tenant: allowed model, quota, route, relay.
        The Responses and Messages APIs (gateway/responses.py, messages.py) come in here with
        the chat completion they translated their request to."""
        model = parsed.model
        request.scope["hpcserve.asked"] = model  # for the audit log, whatever comes of it
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
        # Keys the gateway adds, appended to the body's bytes in one copy (json_members.py);
        # stream_options last, so that _continuous_usage finds it at the end.
        members: list[bytes] = []
        ask_usage = False
        if stream and endpoint in _GENERATING:
            # Usage is what tokens/min and the token metrics count: ask for it, and hide it
            # from a client that did not.
            options = parsed.stream_options  # type: ignore[union-attr]
            if options is None:
                ask_usage = strip_usage = True
            elif not options.include_usage:
                payload = _dict.decode(body)
                payload["stream_options"]["include_usage"] = True
                body = msgspec.json.encode(payload)
                strip_usage = True
        client_salt = getattr(parsed, "cache_salt", None)
        salt = client_salt or ""  # the engine shares blocks only within a salt: hash it in
        if self.config.isolate_tenant_caches and endpoint in _GENERATING:
            salt = tenant_salt(tenant.name, client_salt or "")
            if client_salt is not None:
                body = salted_body(body, salt, replace=True)
            else:
                members.append(salt_member(salt))
        if ask_usage:
            members.append(_INCLUDE_USAGE)
        if members:
            body = with_members(body, *members)
        engine_body, strip_continuous = _continuous_usage(body, parsed, stream, endpoint)
        headers = {
            "Content-Type": "application/json",
            PRIORITY_HEADER: ENGINE_PRIORITY[tenant.config.priority],
        }
        for name in FORWARDED_REQUEST_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        if self.audit.enabled:
            # One id in the audit line, the engine's log and its response id (chatcmpl-<id>).
            if "x-request-id" not in headers:
                headers["x-request-id"] = new_request_id()
            request.scope["hpcserve.request_id"] = headers["x-request-id"]
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
            hints = await self.prefix_hints(model, body, request.headers, salt)
        # Overflow on a queue budget, and a canary alias kept per user (router/queue_wait.py,
        # router/aliases.py).
        if self.external is not None and (budget := self.external.queue_budget_s(tenant, model)):
            hints["queue_budget_s"] = budget
        if user := getattr(parsed, "user", None):
            hints["user"] = user[:256]
        if (self.route_hints is None or endpoint not in _GENERATING) and (
            session := request.headers.get(SESSION_HEADER)  # not read for the hints above
        ):
            hints["user"] = session[:256]
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
            wake = self._waking_pool(model, decision)
            if (
                wake
                and decision is not None
                and not exclude
                and not (self.external is not None and self.external.takes(tenant, model))
            ):
                # A pool at zero: its Routes wake it (router/unserved.py); hold the request.
                try:
                    decision = await self._hold_for_wake(
                        model, wake, tenant.config.priority, hints, request._receive
                    )
                except errors.APIError as err:  # the client went away meanwhile
                    # A pool's served name, or an alias or adapter the registry knows.
                    request.scope["hpcserve.model"] = model
                    _end(span, err.status)
                    raise
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
                    # A LoRA adapter not loaded in time, an alias without replicas, a queue
                    # over budget, a name of a pool at zero: the name exists (503 or overflow).
                    and decision.error == "no_replica"
                    and not wake
                ):
                    _end(span, 404)
                    raise errors.model_not_found(model)
                if model in self.configured_models:
                    request.scope["hpcserve.model"] = model
                if self.external is not None and self.external.takes(tenant, model):
                    request.scope["hpcserve.model"] = model  # a name from the config
                    over_budget = decision is not None and decision.error == OVER_QUEUE_BUDGET
                    try:
                        return await self._overflow(
                            endpoint, tenant, model, body, stream, strip_usage, limited, span,
                            keep_span=over_budget, scope=request.scope,
                        )  # fmt: skip
                    except UpstreamFailed as err:
                        if not over_budget:
                            raise
                        # The external API is down: queue here after all.
                        log.warning("overflow failed, queueing at a replica: %s", err)
                        hints.pop("queue_budget_s", None)
                        failure = err
                        continue
                if failure is not None:
                    _end(span, failure.status)
                    raise failure
                _end(span, 503)
                if wake:
                    raise errors.model_starting(
                        model, self.wake_budgets[wake], wake_retry_after(self.wake_budgets[wake])
                    )
                raise errors.no_replica(model)
            # Only routable names become metric labels: client input must not grow the series.
            request.scope["hpcserve.model"] = model
            exchange = _Exchange(
                self,
                tenant,
                model,
                limited,
                decision.replica_id,
                stream,
                span,
                request.scope,
                route=decision,
            )
            exchange.deployment = self.deployment_metrics(
                model, decision.model_ref, decision.adapter
            )
            watch = exchange.watch = (
                quality.OutputWatch(quality.wants_json(parsed)) if endpoint in _GENERATING else None
            )
            if span is not None:
                assert self.tracing is not None
                self.tracing.inject(span, headers)
            # An alias: the replica knows the version by its served name.
            forward_body = (
                _with_model(engine_body, decision.model) if decision.model else engine_body
            )
            if decision.prefill_replica_id:  # disaggregated: prefill there first (disagg.py)
                forward_body, prefill_failed = await self._prefill_step(
                    decision, endpoint, model, forward_body, headers
                )
                if prefill_failed:
                    exclude = [*exclude, decision.prefill_replica_id]
            try:
                return await self.relay.forward(
                    decision.url + endpoint,
                    forward_body,
                    headers,
                    stream=stream,
                    exchange=exchange,
                    strip_usage=strip_usage,
                    strip_continuous=strip_continuous,
                    watch=watch,
                )
            except UpstreamFailed as err:
                exchange.abandon(failed=True)
                log.warning("replica %s failed before its first byte: %s", decision.replica_id, err)
                failure = err
                exclude = [*exclude, decision.replica_id]
                self.metrics.retries.labels(model).inc()
                continue
            except errors.APIError as err:
                exchange.abandon(failed=err.status >= 500)
                _end(span, err.status)
                if err.status >= 500:
                    self.engine_error(model, err.status, decision.replica_id, request.scope, err)
                raise
        assert failure is not None
        _end(span, failure.status)
        self.engine_error(model, failure.status, "", request.scope, failure)
        raise failure

    async def _prefill_step(
        self,
        decision: RouteReply,
        endpoint: str,
        model: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> tuple[bytes, bool]:
        """A disaggregated request's prefill step on decision.prefill_url (gateway/disagg.py):
        the body for the decode replica, and whether the prefill failed (the decode replica
        then computes the prompt itself). The prefill replica is released either way."""
        try:
            if endpoint not in disagg.GENERATING:
                self.metrics.pd_requests.labels(model, "not_generating", "").inc()
                return body, False
            try:
                params = await disagg.prefill(
                    self.relay,
                    decision.prefill_url + endpoint,
                    body,
                    headers,
                    self.config.pd_prefill_timeout_s,
                )
            except disagg.PrefillFailed as err:
                log.warning(
                    "prefill on replica %s failed (%s), decode replica %s computes the prompt: %s",
                    decision.prefill_replica_id,
                    err.reason,
                    decision.replica_id,
                    err,
                )
                self.metrics.pd_requests.labels(model, "prefill_failed", err.reason).inc()
                return body, True
            self.metrics.pd_requests.labels(model, "transferred", "").inc()
            return disagg.decode_body(body, params), False
        finally:
            self.routing.release(decision.prefill_replica_id, model)

    async def prefix_hints(
        self, model: str, body: bytes, headers: Mapping[str, str], salt: str = ""
    ) -> dict[str, Any]:
        """The Route fields for prefix-aware routing (contracts/prompt_tokens.py RouteHints).

        None when they cannot change the decision: the model has fewer replicas in the
        routing view than `gateway.prefix_hints_min_replicas` (2: one, or none). Otherwise
        the prompt cache is walked here (dict lookups); what it leaves, when over
        `INLINE_HINT_BYTES` characters, is rendered and tokenized on a small thread pool,
        so that a long prompt does not stall every other request on the event loop; with
        `MAX_HINTS_WAITING` already waiting there, the request goes without prefix hints
        (routed on load and session alone: the hints are an optimisation)."""
        route_hints = self.route_hints
        assert route_hints is not None
        view = self.routing.view
        model = view.served_as(model)  # an alias: hashed as its target's model
        if not route_hints.covers(model):
            return route_hints.hints(model, {}, headers, salt)
        replicas = view.replicas_of(route_hints.base_model(model))
        if replicas is not None and replicas < self.config.prefix_hints_min_replicas:
            self.metrics.hints_skipped.labels("one_replica").inc()
            return _session_only(headers)
        if len(body) > HINT_DECODE_INLINE_BYTES:
            plan = None
        else:
            plan = body_plan(route_hints, model, body, headers, salt)
            if plan.work <= INLINE_HINT_BYTES:
                return plan.run()
        if self._hints_waiting >= MAX_HINTS_WAITING:
            log.debug("prefix hints skipped: %d prompts waiting to be tokenized", MAX_HINTS_WAITING)
            self.metrics.hints_skipped.labels("busy").inc()
            return _session_only(headers)
        if self._hint_pool is None:
            self._hint_pool = ThreadPoolExecutor(HINT_THREADS, thread_name_prefix="prefix-hints")
        self._hints_waiting += 1
        try:
            loop = asyncio.get_running_loop()
            if plan is None:
                return await loop.run_in_executor(
                    self._hint_pool, body_hints, route_hints, model, body, headers, salt
                )
            return await loop.run_in_executor(self._hint_pool, plan.run)
        finally:
            self._hints_waiting -= 1

    def _waking_pool(self, model: str, decision: RouteReply | None) -> str:
        """The served name of the pool that may be at zero a request for `model` without a
        replica waits for: `model` itself, or the pool serving the registry version its
        alias or adapter resolved to (RouteReply.model_ref; a base model's name for an
        adapter bound to no version); "": none (a replica was found)."""
        if decision is not None and decision.replica_id:
            return ""
        if model in self.wake_budgets:
            return model
        if decision is None or not decision.model_ref:
            return ""
        ref = decision.model_ref
        pool = self._pool_of_version(ref)
        now = time.monotonic()
        if (
            not pool
            and self.wake_versions_source is not None
            and now - self._wake_versions_read_at >= WAKE_VERSIONS_REREAD_S
        ):
            # A promote or a new version moved a pool's model_ref since the map was read
            self._wake_versions_read_at = now
            self.wake_versions = self.wake_versions_source()
            pool = self._pool_of_version(ref)
        return pool

    def _pool_of_version(self, ref: str) -> str:
        if "@" in ref:
            return self.wake_versions.get(ref, "")
        return next(
            (pool for v, pool in sorted(self.wake_versions.items()) if v.split("@")[0] == ref), ""
        )

    async def _hold_for_wake(
        self, model: str, pool: str, priority: str, hints: Mapping[str, Any], receive: Any
    ) -> RouteReply | None:
        """Hold a request for a model whose pool is at zero (or still starting) until a
        replica of it serves, up to its wake budget (`pool`: the pool's served name, which
        `model` is, or an alias or adapter of its version): ask the router again every
        WAKE_POLL_S (each Route that finds no replica is the demand that wakes the pool).
        Nothing is sent to the client meanwhile, streaming or not. None, or a reply without
        a replica: the budget ran out. A client that disconnects (http.disconnect on the
        ASGI `receive` channel, whose body is read already) ends the hold at once, so its
        Routes no longer keep the pool awake: raises errors.client_gone (499)."""
        deadline = time.monotonic() + self.wake_budgets[pool]
        held = time.monotonic()
        decision: RouteReply | None = None
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.wait((gone,), timeout=min(WAKE_POLL_S, left))
                if gone.done():
                    why = "disconnected" if gone.exception() is None else repr(gone.exception())
                    self.metrics.wake_holds.labels(pool, "disconnected").inc()
                    log.debug(
                        "a request held for %s (pool at zero) is no longer held after %.1f s: "
                        "its client %s",
                        model,
                        time.monotonic() - held,
                        why,
                    )
                    raise errors.client_gone()
                try:
                    decision = await self.routing.route(model, priority=priority, **hints)
                except RouterUnavailable:
                    continue
                if decision.replica_id:
                    self.metrics.wake_holds.labels(pool, "served").inc()
                    return decision
        finally:
            gone.cancel()
        self.metrics.wake_holds.labels(pool, "timeout").inc()
        return decision

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
        keep_span: bool = False,
        scope: MutableMapping[str, Any] | None = None,
    ) -> Response:
        """keep_span: a failure before the first byte leaves the span open (the caller
        routes the request to a replica instead)."""
        assert self.external is not None and self.external_relay is not None
        self.metrics.overflow.labels(model, tenant.name).inc()
        exchange = _Exchange(self, tenant, model, limited, "", stream, span, scope)
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
            if not (keep_span and isinstance(err, UpstreamFailed)):
                _end(span, err.status)
            raise

    def deployment_metrics(
        self, model: str, version: str, adapter: str
    ) -> quality.DeploymentMetrics:
        """The online quality counters of one deployment (gateway/quality.py); the labels
        come from the router (a routable name, a registered version and adapter)."""
        key = (model, version, adapter)
        children = self._deployments.get(key)
        if children is None:
            children = self._deployments[key] = quality.DeploymentMetrics(self.metrics, *key)
        return children

    def model_metrics(self, model: str, tenant: str) -> _ModelMetrics:
        key = (model, tenant)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = _ModelMetrics(self.metrics, model, tenant)
        return children

    def engine_error(
        self, model: str, status: int, replica: str, scope: MutableMapping[str, Any], detail: object
    ) -> None:
        """An engine failure that reaches the client: counted and logged, one line."""
        self.metrics.engine_errors.labels(model, str(status)).inc()
        log.warning(
            "engine error %d for model %s (replica %s, request id %s): %s",
            status,
            model,
            replica or "-",
            _request_id(scope),
            str(detail)[:300],
        )

    def _auth_failed(self, reason: str) -> None:
        """A refused key: counted, and logged (never the key) at most every
        AUTH_LOG_EVERY_S with how many were refused since; each has its audit line."""
        self.metrics.auth_failures.labels(reason).inc()
        self._auth_unreported += 1
        now = time.monotonic()
        if now >= self._auth_report_at:
            log.warning(
                "refused %d request(s) with 401 since the last report, the last one for a %s "
                "API key (hpcserve_gateway_auth_failures_total; the audit log has each)",
                self._auth_unreported,
                reason,
            )
            self._auth_unreported = 0
            self._auth_report_at = now + AUTH_LOG_EVERY_S

    def audit_request(
        self, scope: MutableMapping[str, Any], status: int, exchange: _Exchange | None = None
    ) -> None:
        """The request's audit line (gateway/audit.py)."""
        tenant = scope.get("hpcserve.key")
        if tenant is None and "hpcserve.tenant" not in scope:  # not a relayed request
            tenant = self.keys.peek(_header(scope, b"authorization"))
        request_id = scope.get("hpcserve.request_id") or _header(scope, b"x-request-id")
        client = scope.get("client")
        if exchange is not None:
            model, replica = exchange.model, exchange.replica_id
            prompt, completion = exchange.prompt, exchange.completion
        else:
            model = scope.get("hpcserve.model") or scope.get("hpcserve.asked") or ""
            replica, prompt, completion = "", 0, 0
        self.audit.write(
            AuditRecord(
                time=utc_time(time.time()),
                tenant=tenant.name if tenant is not None else "",
                key_id=tenant.key_id if tenant is not None else "",
                client=client[0] if client else "",
                method=scope.get("method", ""),
                path=scope.get("path", "")[:256],
                model=model[:256],
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                replica=replica,
                request_id=(request_id or new_request_id())[:128],
            )
        )

    def write_usage(self, exchange: _Exchange, status: int) -> None:
        """The request's usage record (contracts/usage.py): one per answer a replica (or the
        external API) gave, whatever its status; a request retried elsewhere has one per try
        that reached a replica's answer."""
        assert self.usage is not None
        now = time.time()
        route = exchange.route
        scope = exchange.scope or {}
        self.usage.write(
            UsageRecord(
                start=round(now - (time.perf_counter() - exchange.started), 3),
                end=round(now, 3),
                tenant=exchange.tenant.name,
                model=exchange.model,
                prompt_tokens=exchange.prompt,
                completion_tokens=exchange.completion,
                status=status,
                replica=exchange.replica_id,
                served=route.model if route is not None else "",
                version=route.model_ref if route is not None else "",
                adapter=route.adapter if route is not None else "",
                key_id=exchange.tenant.key_id,
                request_id=str(
                    scope.get("hpcserve.request_id") or _header(scope, b"x-request-id") or ""
                )[:128],
                external=route is None,
            )
        )


AUTH_LOG_EVERY_S = 10.0


def _request_id(scope: MutableMapping[str, Any]) -> str:
    """The request's id for a log line: the gateway's or the client's X-Request-Id, else a new
    one (kept in the scope, so that every line about the request names the same)."""
    request_id = scope.get("hpcserve.request_id") or _header(scope, b"x-request-id")
    if not request_id:
        request_id = scope["hpcserve.request_id"] = new_request_id()
    return str(request_id)[:128]


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class _ModelMetrics:
    """The labelled children of one (model, tenant), looked up once, not per request."""

    __slots__ = ("tokens_in", "tokens_out", "tpot", "ttft")

    def __init__(self, metrics: GatewayMetrics, model: str, tenant: str) -> None:
        self.ttft = metrics.ttft.labels(model)
        self.tpot = metrics.tpot.labels(model)
        self.tokens_in = metrics.tokens.labels(model, tenant, "in")
        self.tokens_out = metrics.tokens.labels(model, tenant, "out")


def _continuous_usage(
    body: bytes, parsed: validate.Request, stream: bool, endpoint: str
) -> tuple[bytes, bool]:
    """The body for a replica, asking vLLM for the usage so far on every streamed event
    (continuous_usage_stats), so that a stream the client abandons is counted up to where
    it stopped; and whether to cut that usage out for the client. Replicas only: the
    external API may not know the option."""
    if not stream or endpoint not in _GENERATING:
        return body, False
    options = parsed.stream_options  # type: ignore[union-attr]
    if options is not None and options.continuous_usage_stats:
        return body, False
    if body.endswith(_INCLUDE_USAGE_LAST):  # added last above: no decode needed
        kept = memoryview(body)[: -len(_INCLUDE_USAGE_LAST)]
        return b"".join((kept, _INCLUDE_CONTINUOUS, b"}")), True
    payload = _dict.decode(body)
    payload.setdefault("stream_options", {})["continuous_usage_stats"] = True
    return msgspec.json.encode(payload), True


def _session_only(headers: Mapping[str, str]) -> dict[str, Any]:
    session = headers.get(SESSION_HEADER)
    return {"session_key": session[:256]} if session else {}


def _with_model(body: bytes, model: str) -> bytes:
    payload = _dict.decode(body)
    payload["model"] = model
    return msgspec.json.encode(payload)


def _end(span: Any, status: int) -> None:
    if span is not None:
        from hpcserve.gateway.tracing import Tracing  # loaded already: a span exists

        Tracing.finish(span, status, 0, 0)


class _Exchange:
    """One relayed request: what the relay reports ends up in metrics, quotas and the trace."""

    __slots__ = (
        "completion",
        "deployment",
        "first_at",
        "gateway",
        "limited",
        "model",
        "prompt",
        "replica_id",
        "route",
        "scope",
        "span",
        "started",
        "stream",
        "tenant",
        "watch",
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
        scope: MutableMapping[str, Any] | None = None,
        route: RouteReply | None = None,
    ) -> None:
        """scope: the request's; its audit line is then written at done() (a stream's
        tokens and status are known only at its end), not by the endpoint. route: the
        router's answer (None: the external API), for the usage record."""
        self.scope = scope
        self.route = route
        if scope is not None:
            scope["hpcserve.exchange"] = True
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
        # A replica's answer: its deployment's quality counters and what it said (set by
        # the caller; None for the external API).
        self.deployment: quality.DeploymentMetrics | None = None
        self.watch: quality.OutputWatch | None = None
        gateway.metrics.in_flight.inc()

    def first_byte(self) -> None:
        self.first_at = time.perf_counter()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt = prompt_tokens
        self.completion = completion_tokens

    def abandon(self, failed: bool = False) -> None:
        """The relay raised: release the replica; the caller settles quota and trace.
        failed: the engine failed (counted against its deployment)."""
        if failed and self.deployment is not None:
            self.deployment.failed()
        if self.scope is not None:
            self.scope.pop("hpcserve.exchange", None)  # the endpoint writes the audit line
        self.gateway.metrics.in_flight.dec()
        if self.replica_id:
            self.gateway.routing.release(self.replica_id, self.model)

    def done(self, status: int) -> None:
        gateway = self.gateway
        gateway.metrics.in_flight.dec()
        if self.replica_id:
            gateway.routing.release(self.replica_id, self.model)
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
        if self.deployment is not None:
            streamed = self.stream and self.first_at
            ttft = self.first_at - self.started if streamed else None
            self.deployment.answered(status, self.watch, ttft)
        if self.span is not None:
            assert gateway.tracing is not None
            gateway.tracing.finish(self.span, status, self.prompt, self.completion)
        if self.scope is not None and gateway.audit.enabled:
            gateway.audit_request(self.scope, status, self)
        if gateway.usage is not None:
            gateway.write_usage(self, status)
        if status >= 500:
            gateway.engine_error(
                self.model, status, self.replica_id, self.scope or {}, "answered with an error"
            )


Handler = Callable[[Gateway, Request], Awaitable[Response]]


def _endpoint(
    gateway: Gateway, name: str, handler: Handler
) -> Callable[[Request], Awaitable[Response]]:
    metrics = gateway.metrics
    latency = metrics.latency.labels(name)
    # Labelled children looked up once per (model, tenant, status), not per request.
    counters: dict[tuple[str, str, int], Any] = {}
    audited = gateway.audit.enabled and name not in ("health", "metrics")

    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        try:
            response = await handler(gateway, request)
        except errors.APIError as err:
            response = err.response()
        except ClientDisconnect:
            response = Response(status_code=499)
        except Exception as err:  # the last line of defence, not the fix: one line, no trace
            request_id = _request_id(request.scope)
            metrics.internal_errors.labels(name).inc()
            log.error(
                "%s %s failed (request id %s): %s: %s",
                request.scope.get("method", ""),
                request.scope.get("path", ""),
                request_id,
                type(err).__name__,
                str(err)[:300],
            )
            log.debug("the traceback of request %s", request_id, exc_info=True)
            response = errors.server_error(request_id).response()
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
        if audited and "hpcserve.exchange" not in scope:  # else the exchange writes it
            gateway.audit_request(scope, response.status_code)
        return response

    return endpoint


class _HotRequest:
    """What the handlers use of a Starlette Request, straight from the ASGI scope: the hot
    /v1/* endpoints skip Starlette's routing, middleware and Request/Headers objects."""

    __slots__ = ("_receive", "headers", "scope")

    def __init__(self, scope: dict[str, Any], receive: Any) -> None:
        self.scope = scope
        self._receive = receive
        # The first of repeated headers wins, as with Starlette's Headers.get.
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"][::-1]}

    async def stream(self) -> Any:
        while True:
            message = await self._receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                if body:
                    yield body
                if not message.get("more_body", False):
                    return
            elif message["type"] == "http.disconnect":
                raise ClientDisconnect()


def _hot_endpoint(gateway: Gateway, name: str, handler: Handler) -> Any:
    """The ASGI callable of a hot endpoint: the same handler and metrics as `_endpoint`."""
    endpoint = _endpoint(gateway, name, handler)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = _HotRequest(scope, receive)
        response = await endpoint(request)  # type: ignore[arg-type]
        await _send_response(response, scope, receive, send)

    return app


async def _send_response(response: Response, scope: Any, receive: Any, send: Any) -> None:
    if not isinstance(response, StreamingResponse):
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": response.raw_headers,
            }
        )
        await send({"type": "http.response.body", "body": response.body})
        await _run_background(response)
        return
    # uvicorn (ASGI 2.3) drops what is sent to a client that has gone: the relay must be
    # cancelled when it goes (the engine connection is then dropped and vLLM aborts the
    # request). The gateway's own protocol says so (gateway/http_protocol.py); elsewhere
    # a disconnect is only seen by receive(), watched beside the relay.
    loss = scope.get(CONNECTION_LOST)
    try:
        if loss is not None and not loss.happened:
            await _relay_until_lost(response, send, loss)
        else:
            await _relay_watching_receive(response, send, receive)
    finally:
        await _run_background(response)  # the exchange ends, however the relay did


async def _relay_until_lost(response: StreamingResponse, send: Any, loss: ConnectionLoss) -> None:
    """The stream relayed in this task, which the connection's loss cancels: no second task
    and no watcher (~14 us a stream less than _relay_watching_receive)."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def cancel() -> None:
        # Called by the event loop between this task's steps (a transport reports its loss
        # with call_soon), so the cancellation lands at one of the relay's waits, in here.
        nonlocal gone
        if asyncio.current_task() is not task:
            gone = True
            task.cancel()

    loss.watch(cancel)
    try:
        await _relay_stream(response, send)
    except asyncio.CancelledError:
        # The client's going is this task's only cancellation: the request ends here (499).
        if not gone or task.uncancel() > 0:
            raise
    finally:
        loss.unwatch(cancel)


async def _relay_watching_receive(response: StreamingResponse, send: Any, receive: Any) -> None:
    """The stream relayed beside a watcher of receive() that cancels it on http.disconnect
    (Starlette's StreamingResponse does the same with an anyio task group: ~240 us a stream
    here)."""
    loop = asyncio.get_running_loop()
    relaying = loop.create_task(_relay_stream(response, send))
    watcher = loop.create_task(_wait_disconnect(receive))
    try:
        await asyncio.wait((relaying, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not relaying.done():
            relaying.cancel()
        await asyncio.gather(relaying, watcher, return_exceptions=True)
    if not relaying.cancelled() and (failed := relaying.exception()) is not None:
        raise failed


async def _run_background(response: Response) -> None:
    task = response.background
    if task is None:
        return
    if task.is_async:
        await task()
    else:  # the relay's are quick and do no I/O: not worth a thread (Starlette's way)
        task.func(*task.args, **task.kwargs)


async def _relay_stream(response: StreamingResponse, send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    async for chunk in response.body_iterator:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


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
    """The models served now: served names, aliases and LoRA adapters with their replicas;
    only those the tenant may use (its allowed_models)."""
    tenant = gateway.keys.tenant_for(request.headers.get("authorization"))
    allowed = tenant.config.allowed_models
    listed = await _listed_models(gateway)
    data = [
        _model_card(m.id, m.created, m.replicas, m.parent, m.alias_of)
        for m in listed
        if not allowed or m.id in allowed
    ]
    # A pool scaled to zero has no replica, but its model is there: a request wakes it.
    served = {m.id for m in listed}
    data += [
        _model_card(model, 0, 0)
        for model in sorted(gateway.wake_budgets)
        if model not in served and (not allowed or model in allowed)
    ]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(gateway: Gateway, request: Request) -> Response:
    """GET /v1/models/{model} (the SDK's models.retrieve): the model's /v1/models entry. A
    model of the config with no replica now has `replicas: 0` (a request for it waits for one
    or gets 503, not 404). Any other name, or one the tenant may not use, is a 404 in OpenAI's
    shape (model_not_found), as a request naming it would be."""
    tenant = gateway.keys.tenant_for(request.headers.get("authorization"))
    model = request.path_params["model"]
    allowed = tenant.config.allowed_models
    if allowed and model not in allowed:
        raise errors.model_not_found(model)
    for m in await _listed_models(gateway):
        if m.id == model:
            return JSONResponse(_model_card(m.id, m.created, m.replicas, m.parent, m.alias_of))
    if model in gateway.configured_models:
        return JSONResponse(_model_card(model, 0, 0))
    raise errors.model_not_found(model)


async def _listed_models(gateway: Gateway) -> list[Any]:
    try:
        return (await gateway.routing.models()).models
    except RouterUnavailable as err:
        raise errors.APIError(503, str(err), type="service_unavailable", retry_after_s=5) from None


def _model_card(
    model: str, created: int, replicas: int, parent: str = "", alias_of: str = ""
) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "hpcserve",
        "replicas": replicas,
        # A LoRA adapter names its base model, as vLLM's own /v1/models does.
        **({"parent": parent} if parent else {}),
        # An alias names the registry version it routes to (router/aliases.py).
        **({"alias_of": alias_of} if alias_of else {}),
    }


async def health(gateway: Gateway, request: Request) -> Response:
    return PlainTextResponse("ok")


async def metrics(gateway: Gateway, request: Request) -> Response:
    if gateway.metrics_token and not bearer_matches(
        request.headers.get("authorization", ""), gateway.metrics_token
    ):
        gateway.metrics.auth_failures.labels("metrics").inc()
        raise errors.APIError(
            401,
            "/metrics names tenants: send the gateway's metrics token as a bearer token "
            "(the file gateway.metrics_token_file names)",
            type="authentication_error",
            code="invalid_metrics_token",
        )
    body = generate_latest(gateway.metrics_registry)
    workers = gateway.workers
    if workers is not None and not request.headers.get(LOCAL_HEADER):
        # Several workers on this port (gateway/workers.py): every worker's series.
        body = await workers.merged(body, request.headers.get("authorization", ""))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


_HOT: tuple[tuple[str, str, Handler], ...] = (
    ("/v1/chat/completions", "chat", chat_completions),
    ("/v1/completions", "completions", completions),
    ("/v1/embeddings", "embeddings", embeddings),
    ("/v1/rerank", "rerank", rerank),
    ("/rerank", "rerank", rerank),
    ("/v1/score", "score", score),
    ("/score", "score", score),
)


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
        # Served names may hold "/" (org/model): the SDK sends it percent-encoded.
        Route(
            "/v1/models/{model:path}",
            _endpoint(gateway, "models", retrieve_model),
            methods=["GET"],
        ),
        Route("/health", _endpoint(gateway, "health", health), methods=["GET"]),
        Route("/metrics", _endpoint(gateway, "metrics", metrics), methods=["GET"]),
        *(batch_routes(gateway, _endpoint) if gateway.batch is not None else []),
        *responses_routes(gateway, _endpoint),
        *messages_routes(gateway, _endpoint),
        Route("/tokenize", _endpoint(gateway, "tokenize", model_tools.tokenize), methods=["POST"]),
        Route(
            "/detokenize",
            _endpoint(gateway, "detokenize", model_tools.detokenize),
            methods=["POST"],
        ),
    ]
    app = GatewayApp(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed},
    )
    for path, name, handler in _HOT:
        app.hot[path] = _hot_endpoint(gateway, name, handler)
    app.state.gateway = gateway
    return app


class GatewayApp(Starlette):
    """Starlette, except that POSTs to the relayed /v1/* endpoints go straight to their
    handler (`hot`): Starlette's routing and middleware cost a relayed request ~15% of the
    gateway's CPU (docs/benchmarks.md). The same paths stay Starlette routes for the rest
    (405 on other methods)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hot: dict[str, Any] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            hot = self.hot.get(scope["path"])
            if hot is not None:
                try:
                    await hot(scope, receive, send)
                except Exception as err:
                    # Past the endpoint's own catch-all: sending the response failed (a stream
                    # broke). A 500 if nothing was sent yet; one log line, no traceback.
                    log.error(
                        "%s failed while answering (request id %s): %s: %s",
                        scope["path"],
                        _request_id(scope),
                        type(err).__name__,
                        str(err)[:300],
                    )
                    with contextlib.suppress(Exception):
                        await errors.server_error(_request_id(scope)).response()(
                            scope, receive, send
                        )
                return
        await super().__call__(scope, receive, send)


async def _not_found(request: Request, exc: Exception) -> Response:
    return errors.APIError(
        404, f"No such endpoint: {request.url.path}", code="unknown_endpoint"
    ).response()


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return errors.APIError(
        405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed"
    ).response()
