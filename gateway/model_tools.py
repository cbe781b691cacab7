"""Per-model requests that generate nothing: /tokenize and /detokenize (vLLM's), and the
token count of Anthropic's /v1/messages/count_tokens. Each goes to a replica of the model it
names (the model's own tokenizer and chat template), with the caller's key and allowed
models checked; not counted against tenant quotas (no tokens are generated), but counted in
the gateway's request metrics and the audit log like any other endpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from hpcserve.gateway import errors, json_limits
from hpcserve.gateway.batch.priority import ENGINE_PRIORITY, PRIORITY_HEADER
from hpcserve.gateway.errors import APIError, bad_request
from hpcserve.gateway.relay import UpstreamFailed
from hpcserve.gateway.routing_client import RouterUnavailable

if TYPE_CHECKING:
    from hpcserve.gateway.app import Gateway
    from hpcserve.gateway.auth import Tenant

log = logging.getLogger(__name__)

_object = msgspec.json.Decoder(dict[str, Any])


class _Named(msgspec.Struct):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


_named = msgspec.json.Decoder(_Named)


class _Release:
    """The relay's exchange for a request that only needs its replica given back."""

    def __init__(self, gateway: Gateway, replica_id: str, model: str) -> None:
        self.gateway = gateway
        self.replica_id = replica_id
        self.model = model

    def first_byte(self) -> None:
        pass

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        pass

    def done(self, status: int) -> None:
        self.gateway.routing.release(self.replica_id, self.model)


def check_model(gateway: Gateway, tenant: Tenant, model: str) -> None:
    allowed = tenant.config.allowed_models
    if allowed and model not in allowed:
        raise errors.model_not_allowed(tenant.name, model)


async def to_replica(
    gateway: Gateway, request: Request, tenant: Tenant, model: str, path: str, body: dict[str, Any]
) -> Response:
    """POST `body` to `path` on a replica of `model` (one retry on another when the first
    fails before answering); the replica's answer as it is, errors OpenAI-shaped."""
    request.scope["hpcserve.asked"] = model
    check_model(gateway, tenant, model)
    headers = {"Content-Type": "application/json", PRIORITY_HEADER: ENGINE_PRIORITY["interactive"]}
    exclude: list[str] = []
    failure: APIError | None = None
    for _attempt in range(2):
        try:
            decision = await gateway.routing.route(
                model, priority=tenant.config.priority, exclude=exclude
            )
        except RouterUnavailable as err:
            log.warning("routing failed: %s", err)
            raise errors.no_replica(model) from None
        if not decision.replica_id:
            if failure is not None:
                raise failure
            if model not in gateway.configured_models and decision.error in (
                "no_replica",
                "unknown_model",
            ):
                raise errors.model_not_found(model)
            raise errors.no_replica(model)
        if model in gateway.configured_models:
            request.scope["hpcserve.model"] = model
        sent = {**body, "model": decision.model} if decision.model else body
        try:
            return await gateway.relay.forward(
                decision.url + path,
                msgspec.json.encode(sent),
                headers,
                stream=False,
                exchange=_Release(gateway, decision.replica_id, model),
            )
        except UpstreamFailed as err:
            gateway.routing.release(decision.replica_id, model)
            log.warning("replica %s failed before its first byte: %s", decision.replica_id, err)
            failure = err
            exclude.append(decision.replica_id)
        except APIError:
            gateway.routing.release(decision.replica_id, model)
            raise
    assert failure is not None
    raise failure


async def _relay_named(gateway: Gateway, request: Request, path: str) -> Response:
    tenant = gateway.keys.tenant_for(request.headers.get("authorization"))
    request.scope["hpcserve.tenant"] = tenant.name
    request.scope["hpcserve.key"] = tenant
    body = await gateway.read_body(request)
    json_limits.check_body(body)
    try:
        named = _named.decode(body)
        payload = _object.decode(body)
    except msgspec.ValidationError as err:
        raise bad_request(f"Request body: {err}", param="model") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"Request body is not a JSON object: {err}") from None
    return await to_replica(gateway, request, tenant, named.model, path, payload)


async def tokenize(gateway: Gateway, request: Request) -> Response:
    """vLLM's /tokenize ({"model", "prompt"} or {"model", "messages"}) on a replica."""
    return await _relay_named(gateway, request, "/tokenize")


async def detokenize(gateway: Gateway, request: Request) -> Response:
    """vLLM's /detokenize ({"model", "tokens"}) on a replica."""
    return await _relay_named(gateway, request, "/detokenize")
