"""Forward a request body to an engine and relay its answer, streamed or whole.

One pooled aiohttp session per gateway process (httpx measured ~20x slower as a
proxy client here, see docs/benchmarks.md). The request body is forwarded as the
bytes the client sent; nothing is re-encoded on the hot path.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from hpcserve.gateway.errors import upstream_timeout, upstream_unreachable

_HOP_BY_HOP = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
}
_FORWARDED_REQUEST_HEADERS = ("traceparent", "tracestate", "x-request-id")


class Relay:
    def __init__(self, *, upstream_timeout_s: float, connect_timeout_s: float = 10.0) -> None:
        self.upstream_timeout_s = upstream_timeout_s
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=upstream_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(
        self,
        url: str,
        body: bytes,
        request_headers: dict[str, str],
        *,
        stream: bool,
        on_done: Callable[[], None],
    ) -> Response:
        """POST body to url; on_done runs once, when the answer is fully relayed or failed."""
        assert self._session is not None, "Relay.start() was not awaited"
        headers = {"Content-Type": "application/json"}
        for name in _FORWARDED_REQUEST_HEADERS:
            if name in request_headers:
                headers[name] = request_headers[name]
        try:
            upstream = await self._session.post(url, data=body, headers=headers)
        except TimeoutError:
            on_done()
            raise upstream_timeout("gateway.upstream_timeout_s", self.upstream_timeout_s) from None
        except aiohttp.ClientError as err:
            on_done()
            raise upstream_unreachable(f"{url}: {err}") from None
        response_headers = {
            k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
        }
        if not stream or upstream.status != 200:
            try:
                payload = await upstream.read()
            except TimeoutError:
                raise upstream_timeout(
                    "gateway.upstream_timeout_s", self.upstream_timeout_s
                ) from None
            except aiohttp.ClientError as err:
                raise upstream_unreachable(f"{url}: {err}") from None
            finally:
                upstream.release()
                on_done()
            return Response(payload, status_code=upstream.status, headers=response_headers)
        _set_nodelay(upstream)
        done_once = _Once(on_done)
        return StreamingResponse(
            _relay_chunks(upstream, done_once),
            status_code=upstream.status,
            headers=response_headers,
            # Also after a disconnect before the first chunk, when the generator never ran.
            background=BackgroundTask(done_once),
        )


class _Once:
    def __init__(self, func: Callable[[], None]) -> None:
        self._func: Callable[[], None] | None = func

    def __call__(self) -> None:
        func, self._func = self._func, None
        if func is not None:
            func()


async def _relay_chunks(
    upstream: aiohttp.ClientResponse, on_done: Callable[[], None]
) -> AsyncIterator[bytes]:
    # Closing the upstream response when the client goes away (this generator is
    # cancelled or closed) drops the engine connection, and vLLM aborts the request.
    try:
        async for chunk in upstream.content.iter_any():
            yield chunk
    except (TimeoutError, aiohttp.ClientError):
        # Headers are sent already; the client sees the stream end without [DONE].
        return
    finally:
        upstream.close()
        on_done()


def _set_nodelay(upstream: aiohttp.ClientResponse) -> None:
    connection = upstream.connection
    transport = connection.transport if connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
