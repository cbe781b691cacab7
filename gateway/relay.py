"""Forward a request body to an engine and relay its answer, streamed or whole.

One pooled keep-alive client per Relay (gateway/upstream_http.py: asyncio Protocols and
httptools; aiohttp's client was ~46% of the gateway's Python time, httpx far worse, see
docs/benchmarks.md). The request body is forwarded as the bytes the client sent; nothing is
re-encoded on the hot path. The relay reports what happened to an `Exchange` (first byte,
usage, done): done exactly once for every response it returns; when it raises, nothing was
reported.

A failure before the first byte of the answer raises `UpstreamFailed` (the caller tries
another replica); an engine silent past the timeout before answering is a 504. A stream that
fails after its first byte ends with an OpenAI-style error event (`data: {"error": ...}`),
which the openai SDK raises as an APIError, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import msgspec
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from hpcserve.contracts.engine_token import auth_headers
from hpcserve.gateway.errors import (
    APIError,
    error_status,
    openai_error_body,
    openai_error_event,
    upstream_timeout,
    upstream_unreachable,
)
from hpcserve.gateway.quality import OutputWatch
from hpcserve.gateway.upstream_http import (
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)

_HOP_BY_HOP = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"content-encoding",
    }
)
FORWARDED_REQUEST_HEADERS = ("traceparent", "tracestate", "x-request-id")
# An engine answering these before any byte of its answer is retried on another replica.
RETRYABLE_STATUSES = frozenset({502, 503})
_JSON = (b"content-type", b"application/json")
log = logging.getLogger(__name__)


class Exchange(Protocol):
    def first_byte(self) -> None: ...
    def usage(self, prompt_tokens: int, completion_tokens: int) -> None: ...
    def done(self, status: int) -> None: ...


class UpstreamFailed(APIError):
    """The engine failed before the first byte of its answer: safe to try another."""


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _WithUsage(msgspec.Struct):
    usage: Usage | None = None


class _StreamEvent(msgspec.Struct):
    choices: list[msgspec.Raw] = []
    usage: Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)
_event_decoder = msgspec.json.Decoder(_StreamEvent)
_usage_only_decoder = msgspec.json.Decoder(Usage)
_dict_decoder = msgspec.json.Decoder(dict[str, object])


def _report_usage(exchange: Exchange, usage: Usage) -> None:
    completion = usage.completion_tokens
    prompt = usage.prompt_tokens or (usage.total_tokens - completion)
    exchange.usage(prompt, completion)


def relayed_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An engine's response headers as ASGI raw headers for the client: names lowercased,
    hop-by-hop ones (and the length, which the relayed response sets itself) left out."""
    kept = []
    for name, value in headers:
        name = name.lower()
        if name not in _HOP_BY_HOP:
            kept.append((name, value))
    return kept


class Relay:
    def __init__(
        self,
        *,
        upstream_timeout_s: float,
        connect_timeout_s: float = 10.0,
        timeout_setting: str = "gateway.upstream_timeout_s",
        engine_token: str = "",
        engines: bool = True,
    ) -> None:
        """engine_token: presented to every engine (contracts/engine_token.py). engines:
        this relay's upstreams are our engines, so their 401 means they hold another token
        than ours, never the client's fault: tried on another replica, else a 502. The relay
        to the external API has neither (its key is in the headers passed to forward)."""
        self.engines = engines
        self.upstream_timeout_s = upstream_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.timeout_setting = timeout_setting
        self._fixed_headers = auth_headers(engine_token)
        self._client = self._new_client()

    def _new_client(self) -> UpstreamClient:
        return UpstreamClient(
            first_byte_timeout_s=self.upstream_timeout_s,
            idle_timeout_s=self.upstream_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            headers=self._fixed_headers,
        )

    async def start(self) -> None:
        if self._client.closed:  # started again after a close
            self._client = self._new_client()

    async def close(self) -> None:
        await self._client.close()

    async def forward(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        stream: bool,
        exchange: Exchange,
        strip_usage: bool = False,
        strip_continuous: bool = False,
        watch: OutputWatch | None = None,
    ) -> Response:
        """POST body to url with headers. strip_usage: drop the stream's usage-only event;
        strip_continuous: drop the usage from the other events (continuous_usage_stats the
        client did not ask for); watch: sees a successful answer's body or every chunk
        (gateway/quality.py) before `exchange.done`."""
        try:
            upstream = await self._client.request("POST", url, body, headers)
        except UpstreamTimeout as err:
            if err.phase == "connect":
                raise UpstreamFailed(**_unreachable(f"{url}: {err}")) from None
            raise upstream_timeout(self.timeout_setting, self.upstream_timeout_s) from None
        except UpstreamError as err:
            raise UpstreamFailed(**_unreachable(f"{url}: {err}")) from None
        status = upstream.status
        if status in RETRYABLE_STATUSES:
            upstream.close()
            raise UpstreamFailed(**_unreachable(f"{url} answered {status}"))
        if status == 401 and self.engines:
            upstream.close()
            log.error(
                "%s refused the engine token: the gateway and the engine read different "
                "token files (engine.token_file)",
                url,
            )
            raise UpstreamFailed(**_unreachable(f"{url} refused the gateway's engine token"))
        response_headers = relayed_headers(upstream.headers)
        if not stream or status != 200:
            try:
                payload = await upstream.read()
            except UpstreamTimeout:
                raise upstream_timeout(self.timeout_setting, self.upstream_timeout_s) from None
            except UpstreamError as err:
                raise UpstreamFailed(**_unreachable(f"{url}: {err}")) from None
            exchange.first_byte()
            if status == 200:
                try:
                    found = _usage_decoder.decode(payload).usage
                except msgspec.DecodeError:
                    found = None
                if found is not None:
                    _report_usage(exchange, found)
                if watch is not None:
                    watch.whole(payload)
            elif status >= 400:
                payload = openai_error_body(status, payload, headers.get("x-request-id", ""))
                response_headers = [h for h in response_headers if h[0] != b"content-type"]
                response_headers.append(_JSON)
            exchange.done(status)
            response = Response(payload, status_code=status)
            response.raw_headers[:0] = response_headers  # its own: the content-length
            return response
        # The first chunk before the client's answer begins: vLLM checks some fields only
        # once it streams (bad_words that do not tokenize, a grammar that fails to compile),
        # and a stream that opens with an error is answered as that error, a real 4xx/5xx.
        try:
            first = await upstream.next_chunk()
        except UpstreamTimeout:
            upstream.close()
            raise upstream_timeout(self.timeout_setting, self.upstream_timeout_s) from None
        except UpstreamError as err:
            upstream.close()
            raise UpstreamFailed(**_unreachable(f"{url}: {err}")) from None
        at = first.find(_ERROR_EVENT)
        if at >= 0 and _nothing_before(first[:at]):
            upstream.close()
            exchange.first_byte()
            payload = first[at + 6 :].split(b"\n\n", 1)[0]
            status = error_status(payload)
            body = openai_error_body(status, payload, headers.get("x-request-id", ""))
            exchange.done(status)
            return Response(body, status_code=status, media_type="application/json")
        finish = _Once(exchange)
        response = StreamingResponse(
            _relay_chunks(
                upstream,
                exchange,
                finish,
                strip_usage,
                strip_continuous,
                self.timeout_setting,
                headers.get("x-request-id", ""),
                first,
                watch,
            ),
            status_code=status,
            # Also after a disconnect before the first chunk, when the generator never ran.
            background=BackgroundTask(finish, 499),
        )
        response.raw_headers = response_headers
        return response

    async def call(self, url: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """POST body to url and read the whole answer: the gateway's own request to an engine
        (a disaggregated request's prefill step, gateway/disagg.py), reported to no exchange.
        Raises UpstreamFailed when the engine cannot be reached or breaks off, and a 504 when
        it is silent past the timeout: never waits longer."""
        try:
            upstream = await self._client.request("POST", url, body, headers)
            return upstream.status, await upstream.read()
        except UpstreamTimeout as err:
            if err.phase == "connect":
                raise UpstreamFailed(**_unreachable(f"{url}: {err}")) from None
            raise upstream_timeout(self.timeout_setting, self.upstream_timeout_s) from None
        except UpstreamError as err:
            raise UpstreamFailed(**_unreachable(f"{url}: {err}")) from None


def _unreachable(detail: str) -> dict[str, Any]:
    err = upstream_unreachable(detail)
    return {"status": err.status, "message": err.message, "type": err.type, "code": err.code}


class _Once:
    def __init__(self, exchange: Exchange) -> None:
        self._exchange: Exchange | None = exchange

    def __call__(self, status: int) -> None:
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.done(status)


def error_event(message: str, *, code: str) -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


# A stream's bytes are searched with find, not `in`: CPython 3.11's `needle in data` first
# tries the needle as an integer and builds a TypeError it throws away (~100 ns a test,
# dozens a streamed answer; docs/benchmarks.md, issue 23's eleventh pass).
_DONE_EVENT = b"data: [DONE]\n\n"
_ERROR_EVENT = b'data: {"error"'  # vLLM's error event in a stream (quotes inside text are \")


def _nothing_before(events: bytes) -> bool:
    """Whether the events before an error event in a stream's first chunk gave the client
    nothing: none, or only chat's opening role event with empty content."""
    if events and not events.endswith(b"\n\n"):
        return False
    return all(
        event.find(b'"role":"assistant","content":""}') >= 0
        for event in events.split(b"\n\n")
        if event.strip()
    )


def _error_events(block: bytes, request_id: str) -> tuple[bytes, int]:
    """A block of whole events with the engine's error events in OpenAI's shape, and the
    status the first one stands for (0 if none)."""
    failed = 0
    events = block.split(b"\n\n")
    for i, event in enumerate(events):
        if event.startswith(_ERROR_EVENT):
            events[i] = openai_error_event(event[6:], request_id)[:-2]
            failed = failed or error_status(event[6:])
    return b"\n\n".join(events), failed


_USAGE_KEY = b',"usage":{'


def _events_with_usage(
    block: bytes,
    exchange: Exchange,
    strip: bool,
    strip_continuous: bool = False,
    latest: list[bytes] | None = None,
) -> bytes:
    """Report the usage in a block of whole SSE events; drop usage-only events if strip.

    An event that carries choices and the usage so far (continuous_usage_stats) is not
    decoded here: its usage goes to `latest` (reported by `_report_latest` if the stream ends
    without a usage-only event, e.g. when the client goes away), and with strip_continuous
    it is cut out of the event."""
    kept = []
    for event in block.split(b"\n\n"):
        if event.find(b'"usage"') >= 0 and event.startswith(b"data: {"):
            if latest is not None and event.find(b'"choices":[]') < 0:
                # vLLM writes compact JSON with the usage last: cut it out without a decode.
                cut = event.rfind(_USAGE_KEY)
                if cut > 0 and event.endswith(b"}}") and event.find(b"{", cut + 10) < 0:
                    if latest:
                        latest[0] = event[cut + 9 : -1]
                    else:
                        latest.append(event[cut + 9 : -1])
                    kept.append(event[:cut] + b"}" if strip_continuous else event)
                    continue
            event = _usage_event(event, exchange, strip, strip_continuous, latest)
            if not event:
                continue
        kept.append(event)
    return b"\n\n".join(kept)


def _usage_event(
    event: bytes,
    exchange: Exchange,
    strip: bool,
    strip_continuous: bool,
    latest: list[bytes] | None,
) -> bytes:
    """One event with "usage" in it, decoded: the event to relay (b"" to drop it)."""
    try:
        parsed = _event_decoder.decode(event[6:])
    except msgspec.DecodeError:
        return event
    if parsed.usage is None:
        return event
    if not parsed.choices:  # the usage-only event at the end: the stream's final count
        _report_usage(exchange, parsed.usage)
        if latest:
            latest.clear()
        return b"" if strip else event
    if latest is not None:
        latest[:] = [msgspec.json.encode(parsed.usage)]
    else:
        _report_usage(exchange, parsed.usage)
    if not strip_continuous:
        return event
    payload = _dict_decoder.decode(event[6:])
    payload.pop("usage", None)
    return b"data: " + msgspec.json.encode(payload)


def _report_latest(exchange: Exchange, latest: list[bytes]) -> None:
    """The stream ended before its usage-only event: count what the engine reported so far."""
    if latest:
        try:
            usage = _usage_only_decoder.decode(latest[0])
        except msgspec.DecodeError:
            return
        _report_usage(exchange, usage)


async def _relay_chunks(
    upstream: UpstreamResponse,
    exchange: Exchange,
    finish: _Once,
    strip_usage: bool,
    strip_continuous: bool = False,
    timeout_setting: str = "gateway.upstream_timeout_s",
    request_id: str = "",
    first_chunk: bytes = b"",
    watch: OutputWatch | None = None,
) -> AsyncIterator[bytes]:
    # Closing the upstream response when the client goes away (this generator is
    # cancelled or closed) drops the engine connection, and vLLM aborts the request.
    status = 200
    pending = b""  # an event not yet complete
    first = True
    delivered = False  # the client has read the stream's last event, [DONE]
    latest: list[bytes] = []  # the last continuous usage seen, not yet decoded
    try:
        while chunk := first_chunk or await upstream.next_chunk():
            first_chunk = b""
            if first:
                exchange.first_byte()
                first = False
            if watch is not None:
                watch.feed(chunk)
            if (
                not pending
                and chunk.endswith(b"\n\n")
                and chunk.find(b'"usage"') < 0
                and chunk.find(_ERROR_EVENT) < 0
            ):
                yield chunk
                delivered = chunk.endswith(_DONE_EVENT)
                continue
            data = pending + chunk
            cut = data.rfind(b"\n\n")
            if cut < 0:
                pending = data
                continue
            block, pending = data[: cut + 2], data[cut + 2 :]
            block = _events_with_usage(block, exchange, strip_usage, strip_continuous, latest)
            if block.find(_ERROR_EVENT) >= 0:  # the engine failed mid-stream: OpenAI's shape
                block, failed = _error_events(block, request_id)
                status = failed or status
            if block.strip():
                yield block
                delivered = block.endswith(_DONE_EVENT)
        if pending:
            yield pending
    except UpstreamTimeout:
        status = 504
        yield error_event(
            f"The engine went silent mid-stream ({timeout_setting})", code="upstream_timeout"
        )
    except (GeneratorExit, asyncio.CancelledError):
        # The client went away; after [DONE] that is a client done reading before the
        # engine closed its side: the answer was delivered whole.
        if not delivered:
            status = 499
        raise
    except UpstreamError as err:
        status = 502
        yield error_event(f"The engine failed mid-stream: {err}", code="upstream_failed")
    finally:
        upstream.close()
        _report_latest(exchange, latest)
        finish(status)
