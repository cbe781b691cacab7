"""The relay over its HTTP client, against a real asyncio server on loopback: what an engine's
answers, failures and silences become for the gateway's client and for its accounting."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from starlette.responses import StreamingResponse

from hpcserve.gateway.errors import APIError
from hpcserve.gateway.relay import Relay, UpstreamFailed, relayed_headers

Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


class Exchange:
    def __init__(self) -> None:
        self.events: list[object] = []

    def first_byte(self) -> None:
        self.events.append("first byte")

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.events.append(("usage", prompt_tokens, completion_tokens))

    def done(self, status: int) -> None:
        self.events.append(("done", status))


@contextlib.asynccontextmanager
async def engine(script: Script) -> AsyncIterator[str]:
    """A server that reads one request per connection and answers it with `script`."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await script(writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        server.close()


def fixed(raw: bytes) -> Script:
    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(raw)

    return script


def events(*payloads: dict[str, object]) -> list[bytes]:
    return [b"data: " + json.dumps(p, separators=(",", ":")).encode() + b"\n\n" for p in payloads]


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
CHOICE = {"index": 0, "delta": {"content": "hi"}}


# Out of reach unless a test shortens it: the engine answers on the same loop, so a process
# descheduled for seconds must not turn a prompt answer into a timeout.
UNREACHED_S = 60.0


async def forward(
    url: str, *, stream: bool = False, timeout_s: float = UNREACHED_S, **kwargs: bool
):  # type: ignore[no-untyped-def]
    relay = Relay(upstream_timeout_s=timeout_s)
    await relay.start()
    exchange = Exchange()
    try:
        response = await relay.forward(
            url, b"{}", {"Content-Type": "application/json"}, stream=stream, exchange=exchange,
            **kwargs,
        )  # fmt: skip
        body = b""
        if isinstance(response, StreamingResponse):
            async for chunk in response.body_iterator:
                body += chunk  # type: ignore[operator]
            assert response.background is not None
            response.background.func(*response.background.args)
        else:
            body = bytes(response.body)
        return response, body, exchange.events
    finally:
        await relay.close()


def test_relayed_headers_drop_hop_by_hop_and_lowercase() -> None:
    raw = [
        (b"Content-Type", b"application/json"),
        (b"Content-Length", b"12"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"keep-alive"),
        (b"X-Request-Id", b"r1"),
        (b"set-cookie", b"a"),
        (b"set-cookie", b"b"),
    ]
    assert relayed_headers(raw) == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"r1"),
        (b"set-cookie", b"a"),
        (b"set-cookie", b"b"),
    ]


def test_a_whole_answer_is_relayed_with_its_usage_counted() -> None:
    payload = b'{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}'
    raw = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: r1\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )

    async def scenario():  # type: ignore[no-untyped-def]
        async with engine(fixed(raw)) as url:
            return await forward(url)

    response, body, seen = asyncio.run(scenario())
    assert (response.status_code, body) == (200, payload)
    assert response.raw_headers == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"r1"),
        (b"content-length", str(len(payload)).encode()),
    ]
    assert seen == ["first byte", ("usage", 3, 5), ("done", 200)]


def test_an_engine_error_becomes_an_openai_error() -> None:
    flat = b'{"object":"error","message":"bad schema","type":"BadRequestError","code":400}'
    raw = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"

    async def scenario():  # type: ignore[no-untyped-def]
        async with engine(fixed(raw % (len(flat), flat))) as url:
            return await forward(url, stream=True)

    response, body, seen = asyncio.run(scenario())
    assert response.status_code == 400
    assert json.loads(body)["error"]["message"] == "bad schema"
    assert (b"content-type", b"application/json") in response.raw_headers
    assert (b"content-type", b"text/plain") not in response.raw_headers
    assert seen == ["first byte", ("done", 400)]


@pytest.mark.parametrize(
    "raw",
    [b"", b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 20"],
    ids=["hangs up", "503", "half a status line"],
)
def test_a_failure_before_the_first_byte_may_be_retried_elsewhere(raw: bytes) -> None:
    async def scenario() -> None:
        async with engine(fixed(raw)) as url:
            with pytest.raises(UpstreamFailed) as err:
                await forward(url)
            assert (err.value.status, err.value.code) == (502, "upstream_unreachable")
            assert url in err.value.message

    asyncio.run(scenario())


def test_an_engine_silent_before_answering_is_a_504_naming_the_setting() -> None:
    async def silent(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def scenario() -> None:
        async with engine(silent) as url:
            with pytest.raises(APIError) as err:
                await forward(url, timeout_s=0.2)
            assert not isinstance(err.value, UpstreamFailed)
            assert (err.value.status, err.value.code) == (504, "upstream_timeout")
            assert "gateway.upstream_timeout_s" in err.value.message

    asyncio.run(scenario())


def test_a_stream_is_relayed_with_the_usage_it_did_not_ask_for_cut_out() -> None:
    first, second, usage_only, done = events(
        {"id": "c", "choices": [CHOICE], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
        {"id": "c", "choices": [CHOICE], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
        {},
    )
    done = b"data: [DONE]\n\n"
    # An event split across two chunks, and two events in one.
    raw = SSE_HEAD + chunked(first[:20], first[20:] + second, usage_only + done)

    async def scenario():  # type: ignore[no-untyped-def]
        async with engine(fixed(raw)) as url:
            return await forward(url, stream=True, strip_usage=True, strip_continuous=True)

    response, body, seen = asyncio.run(scenario())
    assert response.status_code == 200
    assert (b"content-type", b"text/event-stream") in response.raw_headers
    assert b'"usage"' not in body
    relayed = body.split(b"\n\n")
    assert [json.loads(e[6:])["choices"] for e in relayed[:2]] == [[CHOICE], [CHOICE]]
    assert relayed[2:] == [b"data: [DONE]", b""]
    assert seen == ["first byte", ("usage", 3, 2), ("done", 200)]


@pytest.mark.parametrize(
    ("then", "status", "code"),
    [("hang up", 502, "upstream_failed"), ("go silent", 504, "upstream_timeout")],
)
def test_a_stream_that_fails_midway_ends_with_an_error_event(
    then: str, status: int, code: str
) -> None:
    (first,) = events({"id": "c", "choices": [CHOICE]})

    async def script(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        if then == "go silent":
            await asyncio.sleep(5)
        writer.transport.abort()

    async def scenario():  # type: ignore[no-untyped-def]
        async with engine(script) as url:
            return await forward(url, stream=True, timeout_s=0.3)

    _, body, seen = asyncio.run(scenario())
    assert body.startswith(first)
    assert json.loads(body[len(first) + 6 :])["error"]["code"] == code
    assert seen == ["first byte", ("done", status)]


def test_a_client_gone_mid_stream_closes_the_engine_connection() -> None:
    (event,) = events({"id": "c", "choices": [CHOICE]})
    closed = asyncio.Event()

    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        try:
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            closed.set()

    async def scenario() -> list[object]:
        async with engine(endless) as url:
            relay = Relay(upstream_timeout_s=UNREACHED_S)
            exchange = Exchange()
            response = await relay.forward(url, b"{}", {}, stream=True, exchange=exchange)
            assert isinstance(response, StreamingResponse)
            chunks = response.body_iterator
            assert (await anext(chunks)).startswith(b"data: ")  # type: ignore[union-attr]
            await chunks.aclose()  # type: ignore[attr-defined]
            await asyncio.wait_for(closed.wait(), UNREACHED_S)
            await relay.close()
            return exchange.events

    assert asyncio.run(scenario()) == ["first byte", ("done", 499)]


def test_a_client_gone_after_done_but_before_the_engine_closed_got_the_whole_answer() -> None:
    """A client (the openai SDK) stops reading at [DONE]; the engine may close its side a
    moment later. Cut while the relay waits for that close, the answer was delivered whole:
    200 in the accounting (metrics, audit, the deployment's counts), not 499."""
    (event,) = events({"id": "c", "choices": [CHOICE]})
    done = b"data: [DONE]\n\n"

    async def slow_to_close(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"%x\r\n%s\r\n" % (len(done), done))
        await writer.drain()
        await asyncio.sleep(UNREACHED_S)  # no terminating chunk yet: the stream stays open

    async def scenario() -> list[object]:
        async with engine(slow_to_close) as url:
            relay = Relay(upstream_timeout_s=UNREACHED_S)
            exchange = Exchange()
            response = await relay.forward(url, b"{}", {}, stream=True, exchange=exchange)
            assert isinstance(response, StreamingResponse)
            chunks = response.body_iterator
            read = b""
            while not read.endswith(done):  # the two events, in one chunk or two
                read += await anext(chunks)  # type: ignore[call-overload]
            assert read == event + done
            waiting = asyncio.ensure_future(anext(chunks))  # type: ignore[call-overload]
            await asyncio.sleep(0.05)  # the relay waits for the engine's next bytes
            waiting.cancel()  # the client went away: Starlette cancels the response
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await chunks.aclose()  # type: ignore[attr-defined]
            await relay.close()
            return exchange.events

    assert asyncio.run(scenario()) == ["first byte", ("done", 200)]
