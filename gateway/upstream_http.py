"""A small keep-alive HTTP/1.1 client for the relay: asyncio Protocols + httptools.

What the relay needs and nothing else: POST a body that is already bytes, get the status and
headers, then the body whole or as it arrives (chunked, content-length or close-delimited).

- One pool per origin (scheme, host, port), bounded (`max_connections`; a caller past it waits
  for a connection, within the connect timeout). Idle connections are reused last-in
  first-out, so the warmest stays warm and the rest age out (`keepalive_s`). One the upstream
  closed while idle is dropped from the pool as soon as the loop sees it; one that dies as it
  is reused, before any byte of an answer, is replaced once by a new connection (the request
  was not answered: the race every keep-alive client has with the server's idle timeout).
- Origins come and go (replicas leave when their job ends): one timer, every half
  `keepalive_s` while any pool exists, closes idle connections past `keepalive_s` in every
  pool, and forgets a pool with no connection left and no caller waiting for one. Reuse
  alone cannot age out the sockets of an origin no request goes to any more.
- TCP_NODELAY on every connection, and the request's head and body in one write: no Nagle +
  delayed-ACK stall on small requests and streamed answers. https through asyncio's TLS.
- Timeouts: connect (`UpstreamTimeout` phase "connect"), first byte of the answer ("first
  byte") and silence between bytes after it ("idle"). Silence is checked by one timer per
  client, ticking every tenth of the shorter timeout (at most 1 s) while requests are in
  flight: a timer per request cost ~4 us to arm and cancel here, the tick a few per second.
- Streaming: whatever arrived since the caller last asked is handed over in one piece; past
  `HIGH_WATER` bytes not taken, reading pauses until the caller catches up.
- `UpstreamResponse.close()` drops the connection unless its answer was read to the end: a
  caller that goes away aborts the request upstream (vLLM aborts a request whose client left).

Failures raise `UpstreamError` subclasses; `before_first_byte` says whether any byte of the
answer had arrived (the relay retries those on another replica).
"""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_module
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from hpcserve.gateway.running_loop import RunningLoop

# Body bytes received and not yet taken by a streaming caller before reading pauses.
HIGH_WATER = 1 << 20
_TARGETS_MAX = 4096  # URLs remembered with their pool and request line


class UpstreamError(Exception):
    """The upstream failed to answer. before_first_byte: no byte of an answer had arrived."""

    def __init__(self, message: str, *, before_first_byte: bool = True) -> None:
        super().__init__(message)
        self.before_first_byte = before_first_byte


class UpstreamConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, name not found)."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    """phase: "connect", "first byte" (nothing of the answer yet) or "idle" (silent since)."""

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message, before_first_byte=phase != "idle")
        self.phase = phase


class UpstreamDisconnected(UpstreamError):
    """The connection closed before the answer was complete."""


class UpstreamProtocolError(UpstreamError):
    """What came back is not an HTTP/1.1 response."""


# -- pure pieces -------------------------------------------------------------------------


def request_head(start: bytes, headers: Mapping[str, str], content_length: int) -> bytes:
    """The request's head: `start` (request line and Host), the headers, Content-Length.
    A name or value with a line break in it is refused (it would split the request)."""
    text = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    if text.count("\n") != len(headers) or text.count("\r") != len(headers):
        broken = next(n for n, v in headers.items() if "\r" in n + v or "\n" in n + v)
        raise ValueError(f"HTTP header {broken!r} contains a line break")
    return start + f"{text}Content-Length: {content_length}\r\n\r\n".encode("latin-1")


def header_lines(headers: Mapping[str, str]) -> bytes:
    """Header lines as request_head writes them (without Content-Length or the blank line)."""
    return request_head(b"", headers, 0).removesuffix(b"Content-Length: 0\r\n\r\n")


def request_start(method: str, url: str) -> tuple[str, str, int, bytes]:
    """(scheme, host, port, request line + Host header) for an absolute http(s) URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"Unsupported URL scheme {parts.scheme!r} in {url!r} (http or https)")
    host = parts.hostname
    if not host:
        raise ValueError(f"No host in URL {url!r}")
    default_port = 443 if scheme == "https" else 80
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError(f"Bad port in URL {url!r}") from None
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    host_header = f"[{host}]" if ":" in host else host
    if port != default_port:
        host_header += f":{port}"
    start = f"{method} {target} HTTP/1.1\r\nHost: {host_header}\r\n"
    if any(c in target or c in host_header for c in " \r\n"):
        raise ValueError(f"URL {url!r} contains a space or a line break")
    return scheme, host, port, start.encode("latin-1")


def ends_at_close(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response's body runs until the connection closes (RFC 9112 6.3): neither
    chunked nor with a Content-Length, on a status that has a body."""
    if status in (204, 304):
        return False
    for name, _value in headers:
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            return False
    return True


class ResponseParser:
    """One HTTP/1.1 response from bytes, as they come (httptools): status and headers once
    complete, the body as it is parsed (`take`), `complete` at its end. 1xx answers are
    skipped. Bytes after the end make the connection unfit for another request."""

    __slots__ = (
        "_parser",
        "body",
        "buffered",
        "complete",
        "headers",
        "headers_done",
        "keep_alive",
        "status",
    )

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.buffered = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        # The httptools parser holds bound methods of this object: a reference cycle, let go
        # at the message's end so that a response is freed by its last reference, not by the
        # garbage collector (a young-generation pass every few hundred requests otherwise).
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> None:
        parser = self._parser
        if self.complete or parser is None:
            self.keep_alive = False  # talking after its answer: not to be trusted again
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise UpstreamProtocolError("The upstream switched protocols (not HTTP/1.1)") from None
        except httptools.HttpParserError as err:
            raise UpstreamProtocolError(
                f"Unparseable HTTP response: {err}", before_first_byte=not self.headers_done
            ) from None

    def end_of_input(self) -> bool:
        """The connection closed: whether the response is complete (a close-delimited body
        ends here)."""
        if self.headers_done and not self.complete and ends_at_close(self.status, self.headers):
            self.complete = True
            self.keep_alive = False
        return self.complete

    def take(self) -> bytes:
        """The body parsed since the last take."""
        body = self.body
        chunk = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        return chunk

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        if self.complete or parser is None:
            return
        status = parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the real answer follows
            self.headers = []
            return
        self.status = status
        self.keep_alive = parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body.append(body)
            self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.headers_done and not self.complete:
            self.complete = True
            self._parser = None  # (feed_data, running, holds its own reference)


# -- connections -------------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One TCP connection to an origin; hands what it receives to the response using it."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.idle = False
        self.idle_since = 0.0
        self.requests = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.pool.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # an idle connection that talks is out of step: drop it
            self.abort()
            return
        response._received(data)

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None:
            response._lost(exc)
        self.pool._lost(self)

    def abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()


class _Pool:
    """The connections to one origin: at most `limit`, idle ones reused last-in first-out."""

    def __init__(
        self, client: UpstreamClient, host: str, port: int, ssl: ssl_module.SSLContext | None
    ) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.ssl = ssl
        self.idle: list[_Connection] = []
        self.open = 0  # connecting, busy and idle
        self.connections: set[_Connection] = set()
        self.waiters: deque[asyncio.Future[None]] = deque()

    def __repr__(self) -> str:
        return f"{self.host}:{self.port}"

    async def acquire(self, *, fresh: bool = False) -> _Connection:
        client = self.client
        if not fresh:
            conn = self._pop_idle()
            if conn is not None:
                return conn
        try:
            async with asyncio.timeout(client.connect_timeout_s):
                while self.open >= client.max_connections:
                    if self.idle:  # full, and a fresh one is wanted: the oldest idle one goes
                        self._evict(self.idle.pop(0))
                        continue
                    waiter = client.loop.create_future()
                    self.waiters.append(waiter)
                    try:
                        await waiter
                    finally:
                        if waiter in self.waiters:
                            self.waiters.remove(waiter)
                    if not fresh:
                        conn = self._pop_idle()
                        if conn is not None:
                            return conn
                return await self._connect()
        except TimeoutError:
            raise UpstreamTimeout(
                f"No connection to {self} within {client.connect_timeout_s:g} s",
                phase="connect",
            ) from None
        except OSError as err:
            raise UpstreamConnectError(f"Cannot connect to {self}: {err}") from None

    def _pop_idle(self) -> _Connection | None:
        idle = self.idle
        expired = self.client.loop.time() - self.client.keepalive_s
        while idle:
            conn = idle.pop()
            conn.idle = False
            if not conn.closed and conn.idle_since > expired:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        made: list[_Connection] = []

        def protocol() -> _Connection:
            conn = _Connection(self)
            made.append(conn)
            return conn

        self.open += 1
        try:
            await self.client.loop.create_connection(
                protocol,
                self.host,
                self.port,
                ssl=self.ssl,
                server_hostname=self.host if self.ssl is not None else None,
            )
        except BaseException:
            if made and made[0].transport is not None:
                made[0].abort()  # connected after all: its connection_lost uncounts it
            else:
                self.open -= 1
                self._wake()
            raise
        conn = made[0]
        if conn.closed:
            raise UpstreamConnectError(f"{self} closed the connection as it opened")
        return conn

    def _evict(self, conn: _Connection) -> None:
        conn.idle = False
        self.connections.discard(conn)  # uncounted now, not when its connection_lost comes
        self.open -= 1
        conn.abort()

    def put_back(self, conn: _Connection) -> None:
        conn.requests += 1
        conn.idle = True
        conn.idle_since = now = self.client.loop.time()
        idle = self.idle
        idle.append(conn)
        # The oldest idle one (bottom of the stack) ages out here; the client's sweep does it
        # for pools no request comes back to.
        if idle[0].idle_since < now - self.client.keepalive_s:
            self._evict(idle.pop(0))
        self._wake()

    def sweep(self, expired: float) -> bool:
        """Closes idle connections unused since `expired`; whether the pool is now unused
        (nothing open, connecting or waiting: it can be forgotten)."""
        idle = self.idle
        while idle and (idle[0].closed or idle[0].idle_since <= expired):
            self._evict(idle.pop(0))
        return self.open == 0 and not self.waiters

    def _lost(self, conn: _Connection) -> None:
        if conn not in self.connections:
            return  # evicted: uncounted already
        self.connections.discard(conn)
        self.open -= 1
        if conn.idle:
            conn.idle = False
            self.idle.remove(conn)
        self._wake()

    def _wake(self) -> None:
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in list(self.connections):
            conn.abort()
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamConnectError(f"The client for {self} was closed"))


class UpstreamResponse:
    """An answer being received: `status` and `headers` (as received) now, the body with
    `read()` (whole) or `next_chunk()` (as it arrives). `close()` when done with it: the
    connection goes back to its pool if the answer was read to its end, else it is dropped."""

    __slots__ = (
        "_client",
        "_conn",
        "_error",
        "_got_bytes",
        "_last",
        "_parser",
        "_paused",
        "_waiter",
        "_whole",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection, client: UpstreamClient) -> None:
        self._conn: _Connection | None = conn
        self._client = client
        self._parser = ResponseParser()
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._got_bytes = False
        self._paused = False
        self._whole = False  # read() wants the whole body: reading never pauses
        self._last = client.loop.time()
        client._watch(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        conn.response = self

    async def read(self) -> bytes:
        """The whole body; the connection is then released."""
        parser = self._parser
        self._whole = True
        if self._paused:
            self._resume()
        try:
            while not parser.complete:
                if self._error is not None:
                    raise self._error
                await self._wait()
        except BaseException:
            self.close()
            raise
        body = parser.take() if parser.buffered else b""
        self.close()
        return body

    async def next_chunk(self) -> bytes:
        """The body received since the last call (waiting for some), b"" at its end; the
        connection is released at the end. Raises `UpstreamError` after handing over what
        arrived before the failure."""
        parser = self._parser
        while True:
            if parser.buffered:
                if self._paused:
                    self._resume()
                return parser.take()
            if parser.complete:
                self.close()
                return b""
            if self._error is not None:
                self.close()
                raise self._error
            try:
                await self._wait()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        self._client._inflight.pop(self, None)
        conn.response = None
        parser = self._parser
        if parser.complete and parser.keep_alive and not conn.closed and not self._paused:
            conn.pool.put_back(conn)
        else:
            conn.abort()

    async def _headers(self) -> None:
        parser = self._parser
        while not parser.headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()
        self.status = parser.status
        self.headers = parser.headers

    async def _wait(self) -> None:
        self._waiter = waiter = self._client.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _received(self, data: bytes) -> None:
        self._last = self._client.loop.time()
        self._got_bytes = True
        parser = self._parser
        try:
            parser.feed(data)
        except UpstreamProtocolError as err:
            self._fail(err)
            return
        if not parser.complete and (
            parser.buffered > HIGH_WATER
            and not self._paused
            and not self._whole
            and self._conn is not None
        ):
            self._paused = True
            assert self._conn.transport is not None
            self._conn.transport.pause_reading()
        self._wake()

    def _resume(self) -> None:
        self._paused = False
        conn = self._conn
        if conn is not None and not conn.closed and conn.transport is not None:
            self._last = self._client.loop.time()
            conn.transport.resume_reading()

    def _lost(self, exc: Exception | None) -> None:
        parser = self._parser
        if not parser.end_of_input() and self._error is None:
            pool = self._conn.pool if self._conn is not None else "the upstream"
            if not parser.headers_done:
                what = "before answering" if not self._got_bytes else "in the middle of its headers"
            else:
                what = "in the middle of the answer's body"
            detail = f": {exc}" if exc is not None else ""
            self._error = UpstreamDisconnected(
                f"{pool} closed the connection {what}{detail}",
                before_first_byte=not parser.headers_done,
            )
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        if self._conn is not None:
            self._conn.abort()
        self._wake()

    def _watched(self) -> bool:
        return self._conn is not None and not self._parser.complete and self._error is None

    def _overdue(self, now: float) -> bool:
        """Whether the upstream is silent past its timeout (then failed here)."""
        conn = self._conn
        if conn is None or not self._watched():
            return False
        client = self._client
        if self._paused:  # the caller is slow, not the upstream
            self._last = now
            return False
        timeout = client.idle_timeout_s if self._got_bytes else client.first_byte_timeout_s
        if now < self._last + timeout:
            return False
        if self._got_bytes:
            error = UpstreamTimeout(
                f"{conn.pool} went silent for {timeout:g} s mid-answer", phase="idle"
            )
        else:
            error = UpstreamTimeout(
                f"{conn.pool} did not answer within {timeout:g} s", phase="first byte"
            )
        self._fail(error)
        return True


class UpstreamClient:
    """Keep-alive HTTP/1.1 requests to any number of origins, one bounded pool each.

    Bound to the event loop it is used on (used on another, it starts afresh there).
    `close()` drops every connection."""

    def __init__(
        self,
        *,
        first_byte_timeout_s: float,
        idle_timeout_s: float,
        connect_timeout_s: float = 10.0,
        max_connections: int = 1024,
        keepalive_s: float = 60.0,
        ssl_context: ssl_module.SSLContext | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """`headers`: sent with every request, e.g. the engine token's Authorization
        (written once into each target's cached request start: nothing per request)."""
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        # Checked for line breaks here; empty when none.
        self._fixed_head = header_lines(headers or {})
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._running = RunningLoop()
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._targets: dict[tuple[str, str], tuple[_Pool, bytes]] = {}
        self._ssl = ssl_context  # for https origins; default: the system's trusted CAs
        self.closed = False
        # Responses waiting on their upstream, checked for silence every `_tick_s` by one
        # timer while there are any (cheaper than a timer per request).
        self._inflight: dict[UpstreamResponse, None] = {}
        self._watchdog: asyncio.TimerHandle | None = None
        self._tick_s = min(1.0, max(0.01, min(first_byte_timeout_s, idle_timeout_s) / 10))
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_s = max(0.01, keepalive_s / 2)

    async def request(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        """Send the request; return once the answer's status and headers are in."""
        if self.closed:
            raise UpstreamConnectError("The upstream client is closed")
        loop = self._running.get()
        if loop is not self.loop:
            self._bind(loop)
        target = self._targets.get((method, url))
        if target is None:
            target = self._target(method, url)
        pool, start = target
        # Head and body in one writev(2), the body not copied behind the head.
        data = (request_head(start, headers, len(body)), body)
        fresh = False
        while True:
            conn = await pool.acquire(fresh=fresh)
            reused = conn.requests > 0
            response = UpstreamResponse(conn, self)
            assert conn.transport is not None
            conn.transport.writelines(data)
            try:
                await response._headers()
            except UpstreamDisconnected:
                response.close()
                if reused and not response._got_bytes and not fresh:
                    fresh = True  # it died as it was reused: once more, on a new connection
                    continue
                raise
            except BaseException:
                response.close()
                raise
            return response

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use on this loop: connections made on another one cannot be used here."""
        if self.loop is not None and not self.loop.is_closed():
            for pool in self._pools.values():
                pool.close()
        self._pools.clear()
        self._targets.clear()
        self._inflight.clear()
        self._watchdog = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.loop = loop

    def _target(self, method: str, url: str) -> tuple[_Pool, bytes]:
        scheme, host, port, start = request_start(method, url)
        start += self._fixed_head
        key = (scheme, host, port)
        pool = self._pools.get(key)
        if pool is None:
            ssl = None
            if scheme == "https":
                if self._ssl is None:
                    self._ssl = ssl_module.create_default_context()
                ssl = self._ssl
            pool = self._pools[key] = _Pool(self, host, port, ssl)
            if self._sweeper is None:
                self._sweeper = self.loop.call_later(self._sweep_s, self._sweep)
        if len(self._targets) >= _TARGETS_MAX:
            self._targets.clear()
        target = self._targets[(method, url)] = (pool, start)
        return target

    def _watch(self, response: UpstreamResponse) -> None:
        self._inflight[response] = None
        if self._watchdog is None:
            self._watchdog = self.loop.call_later(self._tick_s, self._check_silence)

    def _check_silence(self) -> None:
        inflight = self._inflight
        now = self.loop.time()
        for response in list(inflight):
            if not response._overdue(now) and response._watched():
                continue
            inflight.pop(response, None)
        self._watchdog = (
            self.loop.call_later(self._tick_s, self._check_silence) if inflight else None
        )

    def _sweep(self) -> None:
        expired = self.loop.time() - self.keepalive_s
        unused = [key for key, pool in self._pools.items() if pool.sweep(expired)]
        if unused:
            gone = {id(self._pools.pop(key)) for key in unused}
            for url, (pool, _) in list(self._targets.items()):
                if id(pool) in gone:
                    del self._targets[url]
        self._sweeper = self.loop.call_later(self._sweep_s, self._sweep) if self._pools else None

    def origins(self) -> int:
        """Origins with a pool (connections open or opening, or callers waiting)."""
        return len(self._pools)

    def idle_connections(self) -> int:
        return sum(len(pool.idle) for pool in self._pools.values())

    def open_connections(self) -> int:
        return sum(pool.open for pool in self._pools.values())

    async def close(self) -> None:
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._pools.values():
            pool.close()
        await asyncio.sleep(0)  # connection_lost callbacks run
