"""Run one batch request the way the gateway runs an interactive one: ask the router for a
replica (at batch priority), relay the body to it, hand back the engine's answer.

Outcomes: an `EngineReply` (any HTTP status the engine chose; final), `NoReplica` (the
model is configured but nothing serves it now: wait, it does not count as a failure) or
`ReplicaFailed` (unreachable, timed out, or a 5xx: retried up to `batch.max_attempts`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from hpcserve.contracts.cache_salt import client_salt_of, salted_body, tenant_salt
from hpcserve.gateway import errors
from hpcserve.gateway.batch.priority import ENGINE_PRIORITY, PRIORITY_HEADER
from hpcserve.gateway.responses import batch_request, batch_response
from hpcserve.gateway.route_hints import body_hints
from hpcserve.gateway.routing_client import RouterUnavailable

if TYPE_CHECKING:
    from hpcserve.contracts.prompt_tokens import RouteHints
    from hpcserve.gateway.relay import Relay
    from hpcserve.gateway.routing_client import Routing

_GENERATING = ("/v1/chat/completions", "/v1/completions")
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
_payload = msgspec.json.Decoder(dict[str, Any])


class EngineReply(msgspec.Struct, frozen=True):
    status_code: int
    body: bytes
    replica_id: str = ""
    version: str = ""  # the registry version (name@N) that answered, for the usage record
    adapter: str = ""


class NoReplica(Exception):
    pass


class ReplicaFailed(Exception):
    def __init__(self, message: str, replica_id: str = "") -> None:
        super().__init__(message)
        self.replica_id = replica_id


def _error_body(err: errors.APIError) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    )


class _Exchange:
    """What the relay reports about one batch request: the replica is released when done."""

    __slots__ = ("_release", "status")

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release
        self.status = 0

    def first_byte(self) -> None:
        pass

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        pass  # read from the stored body instead, with the rest of the result

    def done(self, status: int) -> None:
        self.status = status
        self.release()

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class Executor(Protocol):
    """What the runner needs to run one request (BatchRunner depends on this only)."""

    async def route_hints(
        self, model: str, path: str, body: bytes, tenant: str = ""
    ) -> dict[str, Any]: ...

    async def execute(
        self,
        model: str,
        path: str,
        body: bytes,
        request_id: str,
        *,
        exclude: list[str],
        hints: dict[str, Any],
        tenant: str = "",
    ) -> EngineReply: ...


class RoutedExecutor:
    """An Executor over a routing client, a relay and the prefix hints: a gateway's own
    (gateway/batch/service.py) or a runner process's (gateway/batch/process.py)."""

    def __init__(
        self,
        routing: Routing,
        relay: Relay,
        *,
        route_hints: RouteHints | None,
        configured_models: Collection[str],
        isolate_tenant_caches: bool = False,
    ) -> None:
        """isolate_tenant_caches: each generation carries its tenant's cache_salt, as the
        gateway's interactive ones do (contracts/cache_salt.py)."""
        self.routing = routing
        self.relay = relay
        self.hints = route_hints
        self.configured_models = configured_models
        self.isolate_tenant_caches = isolate_tenant_caches

    def _salt(self, body: bytes, tenant: str) -> str:
        """The tenant's cache salt for this chat or completion body ("": none set)."""
        if not self.isolate_tenant_caches or not tenant:
            return ""
        try:
            return tenant_salt(tenant, client_salt_of(body))
        except msgspec.DecodeError:
            return ""  # execute() answers it

    async def route_hints(
        self, model: str, path: str, body: bytes, tenant: str = ""
    ) -> dict[str, Any]:
        """The prompt's block hashes for prefix-aware routing, as the gateway computes them for
        interactive requests; tokenized in a thread, so the batch never stalls the event loop
        (in a gateway, the one interactive requests share)."""
        hints = self.hints
        if path == RESPONSES:
            try:
                path, body = CHAT, batch_request(body)[1]
            except errors.APIError:
                return {}  # execute() answers it
        if hints is None or path not in _GENERATING or model not in hints:
            return {}
        salt = self._salt(body, tenant)
        return await asyncio.to_thread(body_hints, hints, model, body, {}, salt)

    async def execute(
        self,
        model: str,
        path: str,
        body: bytes,
        request_id: str,
        *,
        exclude: list[str],
        hints: dict[str, Any],
        tenant: str = "",
    ) -> EngineReply:
        routing = self.routing
        responses_request = None
        if path == RESPONSES:  # run as a chat completion, answered as a Response object
            try:
                responses_request, body = batch_request(body)
            except errors.APIError as err:  # checked at upload: only a changed rule gets here
                return EngineReply(err.status, _error_body(err))
            path = CHAT
        if path in _GENERATING and (salt := self._salt(body, tenant)):
            body = salted_body(body, salt, replace=True)
        try:
            decision = await routing.route(model, priority="batch", exclude=exclude, **hints)
        except RouterUnavailable as err:
            raise NoReplica(str(err)) from None
        if not decision.replica_id:
            if model not in self.configured_models and not exclude:
                return EngineReply(404, _error_body(errors.model_not_found(model)))
            raise NoReplica(f"no replica of {model!r} is serving ({decision.error})")
        replica = decision.replica_id
        if decision.model:  # an alias: the replica knows the version by its served name
            body = _with_model(body, decision.model)
        exchange = _Exchange(lambda: routing.release(replica, model))
        try:
            response = await self.relay.forward(
                decision.url + path,
                body,
                {
                    "Content-Type": "application/json",
                    "x-request-id": request_id,
                    PRIORITY_HEADER: ENGINE_PRIORITY["batch"],
                },
                stream=False,
                exchange=exchange,
            )
        except errors.APIError as err:
            exchange.release()
            raise ReplicaFailed(err.message, replica) from None
        if response.status_code >= 500:
            raise ReplicaFailed(
                f"the engine answered {response.status_code}: {bytes(response.body)[:200]!r}",
                replica,
            )
        answer = bytes(response.body)
        if responses_request is not None and response.status_code == 200:
            try:
                answer = batch_response(responses_request, answer)
            except msgspec.DecodeError:
                raise ReplicaFailed("the engine's answer is not JSON", replica) from None
        return EngineReply(
            response.status_code, answer, replica, decision.model_ref, decision.adapter
        )


def _with_model(body: bytes, model: str) -> bytes:
    payload = _payload.decode(body)
    payload["model"] = model
    return msgspec.json.encode(payload)
