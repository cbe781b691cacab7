"""Disaggregated prefill and decode: the gateway's two-step exchange (docs/disaggregation.md).

When the router answers a Route with a prefill replica too (RouteReply.prefill_url, for a
model with prefill and decode pools: router/policies/pd_roles.py), the gateway first sends
the prompt to the prefill replica as a non-streamed request for one token, with vLLM's
`kv_transfer_params` asking it to keep the KV cache for a remote decode; then the client's
request goes to the decode replica, as the client sent it (streamed or not) plus the
transfer parameters the prefill answered with, so the decode engine loads the prompt's KV
cache instead of computing it. For the client nothing changes.

The parameters are those of vLLM's NixlConnector (the prefill answers with its engine id,
block ids and side-channel address, which the decode passes on); the CPU build's storage
connector (ExampleConnector) ignores them and finds the stored KV by the prompt's tokens.

Failure: a prefill step that fails (unreachable, an error status, not answered within
gateway.pd_prefill_timeout_s) is not the client's failure. The decode replica then gets the
request without transfer parameters and computes the prompt itself (counted as
prefill_failed), and the prefill replica is excluded should the decode fail too. A decode
failure before its first byte is retried like any other (gateway/app.py); after it, the
stream ends with an error event. Either way a bounded wait: never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from hpcserve.gateway.errors import APIError
from hpcserve.gateway.relay import Relay

log = logging.getLogger(__name__)

GENERATING = ("/v1/chat/completions", "/v1/completions")
# What the prefill step asks of vLLM's connector: compute the prompt, keep its KV cache for
# a decode elsewhere (NixlConnector's request-side parameters, as vLLM's own proxy sends).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields of the client's request that the prefill step does not take: it is one token,
# whole, with no choices to sample beyond it.
_NOT_FOR_PREFILL = ("stream", "stream_options", "max_completion_tokens", "n", "best_of")

_decode = msgspec.json.Decoder(dict[str, Any])
_encode = msgspec.json.encode


class _Answer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


_answer = msgspec.json.Decoder(_Answer)


def prefill_body(body: bytes) -> bytes:
    """The prefill step's request: the client's prompt and sampling, one token, not
    streamed, with PREFILL_PARAMS."""
    payload = _decode.decode(body)
    for key in _NOT_FOR_PREFILL:
        payload.pop(key, None)
    payload["max_tokens"] = 1
    payload["kv_transfer_params"] = PREFILL_PARAMS
    return _encode(payload)


def decode_body(body: bytes, params: Mapping[str, Any] | None) -> bytes:
    """The client's request for the decode replica, with the prefill's transfer parameters
    (unchanged when it answered none: the storage connector needs none)."""
    if not params:
        return body
    payload = _decode.decode(body)
    payload["kv_transfer_params"] = dict(params)
    return _encode(payload)


# Why a prefill step failed (the `reason` of hpcserve_gateway_pd_requests): not answered
# within gateway.pd_prefill_timeout_s; not reached or broke off; an error status or an
# answer that is no completion.
TIMEOUT, UNREACHABLE, ERROR = "timeout", "unreachable", "error"


class PrefillFailed(Exception):
    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


async def prefill(
    relay: Relay,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout_s: float | None = None,
) -> dict[str, Any] | None:
    """Run the prefill step on `url` (the prefill replica's endpoint URL); its transfer
    parameters (None: it answered none). Raises PrefillFailed, with why. A step not answered
    within `timeout_s` (gateway.pd_prefill_timeout_s) is abandoned: its connection is
    closed, which makes vLLM abort the request. The relay's own timeout
    (gateway.upstream_timeout_s) bounds it as well, and alone when timeout_s is None."""
    try:
        async with asyncio.timeout(timeout_s):
            status, payload = await relay.call(url, prefill_body(body), headers)
    except TimeoutError:
        raise PrefillFailed(
            f"{url} did not answer within {timeout_s:g}s (gateway.pd_prefill_timeout_s)", TIMEOUT
        ) from None
    except APIError as err:  # unreachable, broke off, or silent past the relay's timeout
        reason = TIMEOUT if err.code == "upstream_timeout" else UNREACHABLE
        raise PrefillFailed(err.message, reason) from None
    if status != 200:
        raise PrefillFailed(f"{url} answered {status}: {payload[:200]!r}", ERROR)
    try:
        return _answer.decode(payload).kv_transfer_params
    except msgspec.DecodeError as err:
        raise PrefillFailed(
            f"{url} answered something else than a completion: {err}", ERROR
        ) from None
