"""The relay's HTTP/1.1 client: its pure parts (table tests), then against a real asyncio
server on loopback that answers well, slowly, in chunks, or misbehaves."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from hpcserve.gateway.upstream_http import (
    ResponseParser,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamTimeout,
    ends_at_close,
    request_head,
    request_start,
)
from tests.waiting import until

# -- pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "http://127.0.0.1:8000/v1/chat/completions",
            ("http", "127.0.0.1", 8000, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"),
        ),
        ("http://h/x?a=1", ("http", "h", 80, b"POST /x?a=1 HTTP/1.1\r\nHost: h\r\n")),
        ("https://api.example.com/v1", ("https", "api.example.com", 443, b"POST /v1 HTTP/1.1\r\nHost: api.example.com\r\n")),
        ("http://[::1]:9/", ("http", "::1", 9, b"POST / HTTP/1.1\r\nHost: [::1]:9\r\n")),
        ("http://h:81", ("http", "h", 81, b"POST / HTTP/1.1\r\nHost: h:81\r\n")),
    ],
)  # fmt: skip
def test_request_start(url: str, expected: tuple[str, str, int, bytes]) -> None:
    assert request_start("POST", url) == expected


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("ftp://h/x", "Unsupported URL scheme 'ftp'"),
        ("/v1/chat", "Unsupported URL scheme ''"),
        ("http:///x", "No host"),
        ("http://h:99999/x", "Bad port"),
        ("http://h/a b", "contains a space"),
    ],
)
def test_bad_urls_are_refused_naming_the_problem(url: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        request_start("POST", url)


def test_request_head_in_one_piece_and_line_breaks_refused() -> None:
    head = request_head(b"POST / HTTP/1.1\r\nHost: h\r\n", {"a": "1", "traceparent": "00-x"}, 12)
    assert (
        head
        == b"POST / HTTP/1.1\r\nHost: h\r\na: 1\r\ntraceparent: 00-x\r\nContent-Length: 12\r\n\r\n"
    )
    for headers in ({"x-request-id": "a\r\nInjected: 1"}, {"x\nb": "1"}, {"x": "a\rb"}):
        with pytest.raises(ValueError, match="contains a line break"):
            request_head(b"", headers, 0)


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (200, [], True),
        (200, [(b"Content-Type", b"text/plain")], True),
        (200, [(b"Content-Length", b"0")], False),
        (200, [(b"transfer-encoding", b"chunked")], False),
        (204, [], False),
        (304, [], False),
    ],
)
def test_ends_at_close(status: int, headers: list[tuple[bytes, bytes]], expected: bool) -> None:
    assert ends_at_close(status, headers) is expected


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"7\r\ndata: 1\r\n9\r\n\n\ndata: 2\r\n4\r\n\n\n\n\n\r\n0\r\n\r\n"
)


@pytest.mark.parametrize(
    ("raw", "status", "body", "complete", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 200, b"hello", True, True),
        (CHUNKED, 200, b"data: 1\n\ndata: 2\n\n\n\n", True, True),
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", 404, b"", True, True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", 200, b"ok", True, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 200, b"ok", True, False),
        (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", 200, b"until the end", False, False),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 1\r\n\r\nx", 201, b"x", True, True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n", 200, b"ok", True, False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\npart", 200, b"part", False, True),
    ],
)  # fmt: skip
def test_parser_whole_and_split_at_every_byte(
    raw: bytes, status: int, body: bytes, complete: bool, keep_alive: bool
) -> None:
    for cut in range(len(raw) + 1):
        parser = ResponseParser()
        received = b""
        for piece in (raw[:cut], raw[cut:]):
            if piece:
                parser.feed(piece)
                received += parser.take() if parser.buffered else b""
        assert (parser.status, received, parser.complete) == (status, body, complete), cut
        assert parser.keep_alive is keep_alive, cut
        assert parser.headers_done


def test_parser_keeps_headers_as_received_and_ends_a_close_delimited_body_at_eof() -> None:
    parser = ResponseParser()
    parser.feed(b"HTTP/1.1 200 OK\r\nX-Thing: A\r\nx-thing: b\r\n\r\nabc")
    assert parser.headers == [(b"X-Thing", b"A"), (b"x-thing", b"b")]
    assert not parser.complete
    assert parser.end_of_input()
    unfinished = ResponseParser()
    unfinished.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nab")
    assert not unfinished.end_of_input()


def test_a_complete_response_is_freed_by_reference_counting_alone() -> None:
    """No reference cycle per request: the relay's answers do not feed the collector."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(100):
            parser = ResponseParser()
            parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            assert parser.complete and parser.take() == b"ok"
            del parser
        assert gc.collect() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("raw", "before_first_byte"),
    [
        (b"SMTP ready\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", False),
    ],
)
def test_parser_refuses_what_is_not_http(raw: bytes, before_first_byte: bool) -> None:
    parser = ResponseParser()
    with pytest.raises(UpstreamProtocolError, match="Unparseable HTTP response") as err:
        parser.feed(raw)
    assert err.value.before_first_byte is before_first_byte


# -- against a real server on loopback -----------------------------------------------------

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """An asyncio HTTP/1.1 server on loopback; `handlers[path]` answers each request."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.closed = asyncio.Event()
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                length = next(
                    int(line.split(":")[1]) for line in lines if line.startswith("Content-Length")
                )
                body = await reader.readexactly(length)
                assert b"Host: 127.0.0.1:" in head
                await self.handlers[path](body, reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            self.closed.set()
            writer.close()


@contextlib.asynccontextmanager
async def serving(handlers: dict[str, Handler]) -> AsyncIterator[Server]:
    server = Server(handlers)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    async with listener:
        yield server
        listener.close()


def answer(body: bytes, status: str = "200 OK") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def echo(body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    peer_port = writer.get_extra_info("peername")[1]
    writer.write(answer(b"%d:" % peer_port + body))


async def stall(body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(5)


def client(**kwargs: float) -> UpstreamClient:
    # Out of reach unless a test shortens one: the server answers on the same loop, so a
    # process descheduled for seconds must not turn a prompt answer into a timeout.
    options = {"first_byte_timeout_s": 60.0, "idle_timeout_s": 60.0, "connect_timeout_s": 60.0}
    return UpstreamClient(**{**options, **kwargs})  # type: ignore[arg-type]


def test_keep_alive_reuses_one_connection_with_nodelay_set() -> None:
    async def scenario() -> tuple[list[bytes], int, int]:
        async with serving({"/echo": echo}) as server:
            upstream = client()
            bodies = []
            for i in range(3):
                response = await upstream.request(
                    "POST", server.url + "/echo", b"req%d" % i, {"Content-Type": "application/json"}
                )
                assert response.status == 200
                body = await response.read()
                assert response.headers == [(b"Content-Length", str(len(body)).encode())]
                bodies.append(body)
            (pool,) = upstream._pools.values()
            (conn,) = pool.idle
            assert conn.transport is not None
            sock = conn.transport.get_extra_info("socket")
            nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            await upstream.close()
            return bodies, server.connections, nodelay

    bodies, connections, nodelay = asyncio.run(scenario())
    port = bodies[0].split(b":")[0]
    assert bodies == [port + b":req0", port + b":req1", port + b":req2"]
    assert connections == 1
    assert nodelay


def test_idle_connections_are_reused_last_in_first_out_within_the_bound() -> None:
    gate = asyncio.Event()

    async def slow(body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        await echo(body, reader, writer)

    async def scenario() -> None:
        async with serving({"/slow": slow, "/echo": echo}) as server:
            upstream = client(max_connections=2)
            calls = [
                asyncio.ensure_future(upstream.request("POST", server.url + "/slow", b"", {}))
                for _ in range(5)
            ]
            await until("two connections", lambda: server.open == 2)
            await asyncio.sleep(0.1)  # the other three stay waiting (most_open is checked too)
            assert server.open == 2, "two connections at most, the other three wait"
            gate.set()
            ports = set()
            for call in calls:
                ports.add((await (await call).read()).split(b":")[0])
            assert len(ports) == 2 and server.most_open == 2 and server.connections == 2
            (pool,) = upstream._pools.values()
            last_released = pool.idle[-1].transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
            again = await (await upstream.request("POST", server.url + "/echo", b"", {})).read()
            assert again.split(b":")[0] == str(last_released).encode()
            await upstream.close()

    asyncio.run(scenario())


def test_a_caller_past_the_bound_waits_at_most_the_connect_timeout() -> None:
    async def scenario() -> None:
        never = asyncio.Event()

        async def hold(body: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await never.wait()

        async with serving({"/hold": hold}) as server:
            # The held request must not give its connection back while the second one waits,
            # even if this process is descheduled for seconds: no first-byte deadline in reach.
            upstream = client(max_connections=1, connect_timeout_s=0.2, first_byte_timeout_s=600)
            held = asyncio.ensure_future(upstream.request("POST", server.url + "/hold", b"", {}))
            while server.open < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(UpstreamTimeout, match=r"No connection to 127\.0\.0\.1") as err:
                await upstream.request("POST", server.url + "/hold", b"", {})
            assert err.value.phase == "connect" and err.value.before_first_byte
            held.cancel()
            await upstream.close()

    asyncio.run(scenario())


def test_a_connection_the_upstream_closed_is_replaced() -> None:
    async def once(body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await echo(body, reader, writer)
        await writer.drain()
        writer.close()  # keep-alive announced, then closed while idle

    async def scenario() -> None:
        async with serving({"/once": once}) as server:
            upstream = client()
            for _ in range(3):
                response = await upstream.request("POST", server.url + "/once", b"x", {})
                assert (await response.read()).endswith(b":x")
                await until("the closed one left the pool", lambda: not upstream.idle_connections())
            assert server.connections == 3
            assert upstream.open_connections() == 0
            await upstream.close()

    asyncio.run(scenario())


def test_a_reused_connection_that_dies_unanswered_is_retried_once_on_a_new_one() -> None:
    served = []

    async def drops_second(
        body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        served.append(body)
        if len(served) == 2:  # as if its keep-alive timeout hit just as the request came
            writer.transport.abort()
            return
        await echo(body, reader, writer)

    async def scenario() -> None:
        async with serving({"/x": drops_second}) as server:
            upstream = client()
            for body in (b"a", b"b"):
                response = await upstream.request("POST", server.url + "/x", body, {})
                assert (await response.read()).endswith(b":" + body)
            assert server.connections == 2
            await upstream.close()

    asyncio.run(scenario())
    assert served == [b"a", b"b", b"b"]


def test_a_fresh_connection_closed_unanswered_fails_before_the_first_byte() -> None:
    async def hang_up(
        body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.transport.abort()

    async def scenario() -> None:
        async with serving({"/x": hang_up}) as server:
            upstream = client()
            with pytest.raises(UpstreamDisconnected, match="closed the connection before") as err:
                await upstream.request("POST", server.url + "/x", b"", {})
            assert err.value.before_first_byte
            await upstream.close()

    asyncio.run(scenario())


def test_nothing_listening_is_a_connect_error() -> None:
    async def scenario() -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # bound, not listening: refused
            upstream = client()
            with pytest.raises(UpstreamConnectError, match=f"Cannot connect to 127.0.0.1:{port}"):
                await upstream.request("POST", f"http://127.0.0.1:{port}/x", b"", {})
            assert upstream.open_connections() == 0
            await upstream.close()

    asyncio.run(scenario())


def test_chunks_are_handed_over_as_they_arrive() -> None:
    sent = asyncio.Event()
    go_on = asyncio.Event()

    async def sse(body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"9\r\ndata: 1\n\n\r\n")
        sent.set()
        await go_on.wait()
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")

    async def scenario() -> None:
        async with serving({"/sse": sse}) as server:
            upstream = client()
            response = await upstream.request("POST", server.url + "/sse", b"{}", {})
            assert await response.next_chunk() == b"data: 1\n\n"
            assert not go_on.is_set(), "the first event came before the second was sent"
            go_on.set()
            assert await response.next_chunk() == b"data: 2\n\n"
            assert await response.next_chunk() == b""
            assert upstream.idle_connections() == 1, "read to its end: kept"
            await upstream.close()

    asyncio.run(scenario())


async def half_then_close(
    body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()


def test_a_body_cut_short_fails_after_the_first_byte() -> None:
    async def scenario() -> None:
        async with serving({"/half": half_then_close}) as server:
            upstream = client()
            response = await upstream.request("POST", server.url + "/half", b"", {})
            with pytest.raises(UpstreamDisconnected, match="middle of the answer's body") as err:
                await response.read()
            assert not err.value.before_first_byte
            streamed = await upstream.request("POST", server.url + "/half", b"", {})
            assert await streamed.next_chunk() == b"0123456789"
            with pytest.raises(UpstreamDisconnected):
                await streamed.next_chunk()
            assert upstream.open_connections() == 0
            await upstream.close()

    asyncio.run(scenario())


def test_silence_before_and_after_the_first_byte_times_out() -> None:
    async def stall_mid_body(
        body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await asyncio.sleep(5)

    async def scenario() -> None:
        async with serving({"/stall": stall, "/mid": stall_mid_body}) as server:
            upstream = client(first_byte_timeout_s=0.2, idle_timeout_s=0.1)
            with pytest.raises(UpstreamTimeout, match=r"did not answer within 0\.2 s") as err:
                await upstream.request("POST", server.url + "/stall", b"", {})
            assert err.value.phase == "first byte" and err.value.before_first_byte
            response = await upstream.request("POST", server.url + "/mid", b"", {})
            assert await response.next_chunk() == b"0123456789"
            with pytest.raises(UpstreamTimeout, match=r"went silent for 0\.1 s") as err:
                await response.next_chunk()
            assert err.value.phase == "idle" and not err.value.before_first_byte
            await asyncio.sleep(0.05)
            assert upstream.open_connections() == 0
            await upstream.close()

    asyncio.run(scenario())


def test_a_caller_that_goes_away_closes_the_upstream_connection() -> None:
    async def endless(
        body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"9\r\ndata: x\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        async with serving({"/endless": endless}) as server:
            upstream = client()
            response = await upstream.request("POST", server.url + "/endless", b"", {})
            assert (await response.next_chunk()).startswith(b"data: x")
            waiting = asyncio.ensure_future(response.next_chunk())
            await asyncio.sleep(0)
            waiting.cancel()  # as when the gateway's client disconnects
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await asyncio.wait_for(server.closed.wait(), 60)
            assert upstream.open_connections() == 0
            await upstream.close()

    asyncio.run(scenario())


def test_a_close_delimited_body_is_read_to_the_end_and_not_reused() -> None:
    async def old_style(
        body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with serving({"/old": old_style}) as server:
            upstream = client()
            response = await upstream.request("POST", server.url + "/old", b"", {})
            assert await response.read() == b"all of it"
            assert upstream.idle_connections() == 0
            await upstream.close()

    asyncio.run(scenario())


def test_https_with_the_servers_certificate_checked() -> None:
    """The overflow API is reached over https: asyncio's TLS, certificate and name checked.
    tests/unit/data/loopback-tls.pem: a self-signed certificate for 127.0.0.1 and its key."""
    pem = str(Path(__file__).parent / "data" / "loopback-tls.pem")
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(pem)

    async def scenario() -> None:
        listener = await asyncio.start_server(
            Server({"/echo": echo}).serve, "127.0.0.1", 0, ssl=server_side
        )
        port = listener.sockets[0].getsockname()[1]
        async with listener:
            trusting = client(ssl_context=ssl.create_default_context(cafile=pem))  # type: ignore[arg-type]
            for body in (b"a", b"b"):
                response = await trusting.request(
                    "POST", f"https://127.0.0.1:{port}/echo", body, {}
                )
                assert (await response.read()).endswith(b":" + body)
            assert trusting.open_connections() == 1
            await trusting.close()
            with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client().request("POST", f"https://127.0.0.1:{port}/echo", b"", {})
            listener.close()

    asyncio.run(scenario())


# -- origins that leave -------------------------------------------------------------------


def test_an_origin_no_request_goes_to_any_more_is_closed_and_forgotten() -> None:
    """A replica whose job ended, or that left the routing view: its idle connection and
    its pool must not stay for the life of the gateway."""

    async def scenario() -> None:
        async with serving({"/echo": echo}) as gone, serving({"/echo": echo}) as staying:
            upstream = client(keepalive_s=0.3)
            for server in (gone, staying):
                await (await upstream.request("POST", server.url + "/echo", b"", {})).read()
            assert upstream.origins() == 2 and upstream.idle_connections() == 2
            # Only `staying` is used from now on, back to back: its connection is never idle
            # across a loop iteration, so no sweep can find it idle however long this
            # process is descheduled, while `gone`'s ages out.
            async with asyncio.timeout(60):
                while not gone.closed.is_set():
                    await (await upstream.request("POST", staying.url + "/echo", b"", {})).read()
            assert gone.open == 0, "the departed origin's idle socket was closed"
            assert upstream.origins() == 1 and upstream.idle_connections() == 1
            assert all(gone.url not in url for _, url in upstream._targets)
            assert staying.connections == 1, "the origin in use kept its connection"
            again = await upstream.request("POST", gone.url + "/echo", b"back", {})
            assert (await again.read()).endswith(b":back") and gone.connections == 2
            await upstream.close()

    asyncio.run(scenario())


def test_a_pool_in_use_or_closed_by_its_origin() -> None:
    """Busy past keepalive_s: kept (its connection goes back to it). Every connection
    closed by the origin: forgotten at the next sweep, without waiting for keepalive_s."""

    async def slow(body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.4)
        await echo(body, reader, writer)

    async def once(body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await echo(body, reader, writer)
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with serving({"/slow": slow, "/once": once}) as server:
            upstream = client(keepalive_s=0.1)
            response = await upstream.request("POST", server.url + "/slow", b"x", {})
            assert (await response.read()).endswith(b":x")
            assert upstream.origins() == 1 and upstream.idle_connections() == 1
            await (await upstream.request("POST", server.url + "/once", b"", {})).read()
            await asyncio.wait_for(server.closed.wait(), 60)
            await until(
                "the pool forgotten at a sweep",
                lambda: upstream.origins() == 0 and upstream.open_connections() == 0,
            )
            await upstream.close()

    asyncio.run(scenario())
