"""The gateway's HTTP protocol (gateway/http_protocol.py): a response head is held for the
next write and leaves with it in one send, or alone at the end of the loop iteration; on a
real socket pair, then through a real uvicorn server with the httpx client. A connection's
loss reaches what a request watches of it (ConnectionLoss), and the gateway's stream relay
ends on it in its own task (app.py _send_response)."""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from hpcserve.gateway.app import _send_response
from hpcserve.gateway.http_protocol import (
    CONNECTION_LOST,
    ConnectionLoss,
    OneSendHttpProtocol,
    OneSendTransport,
)
from tests.ports import free_port

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"


class Sends:
    """The real transport, with its write calls counted."""

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self.calls: list[str] = []

    def write(self, data: bytes) -> None:
        self.calls.append("write")
        self.real.write(data)

    def writelines(self, chunks: Any) -> None:
        self.calls.append("writelines")
        self.real.writelines(chunks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def on_a_socket_pair(
    body: Callable[[OneSendTransport, Sends, socket.socket], Awaitable[None]],
) -> None:
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    sends = Sends(transport)  # type: ignore[arg-type]
    try:
        await body(OneSendTransport(sends, loop), sends, peer)  # type: ignore[arg-type]
    finally:
        transport.close()
        peer.close()


async def received(peer: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < size:
        chunk = await asyncio.wait_for(loop.sock_recv(peer, 65536), 5)
        if not chunk:
            break
        data += chunk
    return data


def test_a_head_and_its_body_written_in_one_iteration_leave_in_one_send() -> None:
    async def body(one: OneSendTransport, sends: Sends, peer: socket.socket) -> None:
        one.write(HEAD)
        one.write(b"hello")
        assert sends.calls == ["writelines"]
        assert await received(peer, len(HEAD) + 5) == HEAD + b"hello"
        await asyncio.sleep(0)  # the end-of-iteration flush finds nothing held
        assert sends.calls == ["writelines"]

    asyncio.run(on_a_socket_pair(body))


def test_a_head_alone_leaves_at_the_end_of_its_iteration() -> None:
    async def body(one: OneSendTransport, sends: Sends, peer: socket.socket) -> None:
        one.write(HEAD)  # a stream whose first event is still at the engine
        assert sends.calls == []
        assert await received(peer, len(HEAD)) == HEAD
        assert sends.calls == ["write"]
        one.write(b"data: 1\n\n")  # not a head: written at once
        assert sends.calls == ["write", "write"]
        assert await received(peer, 9) == b"data: 1\n\n"

    asyncio.run(on_a_socket_pair(body))


def test_closing_writes_a_held_head_first() -> None:
    async def body(one: OneSendTransport, sends: Sends, peer: socket.socket) -> None:
        one.write(HEAD)
        one.close()
        assert await received(peer, len(HEAD) + 1) == HEAD  # then the end of the stream
        assert one.is_closing()

    asyncio.run(on_a_socket_pair(body))


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/fail":
        raise RuntimeError("an app bug: uvicorn answers 500")
    if path == "/watched":
        loss: ConnectionLoss = scope[CONNECTION_LOST]
        loss.watch(app.lost.set)  # type: ignore[attr-defined]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await app.lost.wait()  # type: ignore[attr-defined]
        assert loss.happened
        return
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await app.gate.wait()  # type: ignore[attr-defined]
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if path in ("/collect", "/collect-late"):  # the whole body: its digest and pieces
        if path == "/collect-late":  # the pieces sent meanwhile wait together in the cycle
            await asyncio.sleep(0.3)
        pieces: list[bytes] = []
        while True:
            message = await receive()
            assert type(message["body"]) is bytes
            pieces.append(message["body"])
            if not message.get("more_body"):
                break
        answer = b"%s %d" % (hashlib.sha256(b"".join(pieces)).hexdigest().encode(), len(pieces))
        headers = [(b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})
        return
    message = await receive()
    echo = message.get("body", b"") or b"empty"
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(echo))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": echo})


def test_through_uvicorn_answers_streams_and_errors_are_whole() -> None:
    async def main() -> None:
        app.gate = asyncio.Event()  # type: ignore[attr-defined]
        app.lost = asyncio.Event()  # type: ignore[attr-defined]
        port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            http=OneSendHttpProtocol,
            lifespan="off",
            log_config=None,
            access_log=False,
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for i in range(3):  # one kept-alive connection, answer after answer
                    answer = await client.post("/echo", content=b"ping %d" % i)
                    assert (answer.status_code, answer.content) == (200, b"ping %d" % i)
                async with client.stream("GET", "/stream") as streamed:
                    # The head arrived while the first event is still held back by the app.
                    assert streamed.status_code == 200
                    app.gate.set()  # type: ignore[attr-defined]
                    assert await streamed.aread() == b"data: 1\n\ndata: 2\n\n"
                failed = await client.get("/fail")
                assert failed.status_code == 500
                assert (await client.post("/echo", content=b"after")).content == b"after"
            # A client that goes mid-stream: what its request watches is called.
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
                client.stream("GET", "/watched") as streamed,
            ):
                async for _ in streamed.aiter_bytes():
                    break
            await asyncio.wait_for(app.lost.wait(), 10)  # type: ignore[attr-defined]
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)

    asyncio.run(main())


@pytest.mark.parametrize("data", [b"HTTP/1.1 ", bytearray(b"HTTP/1.1 204 No Content\r\n\r\n")])
def test_anything_that_starts_like_a_head_is_held_and_kept_in_order(data: bytes) -> None:
    async def body(one: OneSendTransport, sends: Sends, peer: socket.socket) -> None:
        one.write(data)
        one.write(b"x")
        one.write(b"y")
        assert sends.calls == ["writelines", "write"]
        assert await received(peer, len(data) + 2) == bytes(data) + b"xy"

    asyncio.run(on_a_socket_pair(body))


class Relayed:
    """A stream the relay sends on: its chunks, how it ended (the BackgroundTask's status)
    and whether the engine's side was closed."""

    def __init__(self, chunks: int, wait: asyncio.Event | None = None) -> None:
        self.chunks, self.wait = chunks, wait
        self.sent: list[dict[str, Any]] = []
        self.finished: list[int] = []
        self.engine_closed = False

    async def body(self) -> Any:
        status = 200
        try:
            for i in range(self.chunks):
                yield b"data: %d\n\n" % i
                if self.wait is not None:
                    await self.wait.wait()
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.engine_closed = True
            self.finished.append(status)

    def response(self) -> StreamingResponse:
        return StreamingResponse(self.body(), background=BackgroundTask(self.finished.append, 0))

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def never_receive() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


def test_a_stream_is_relayed_whole_in_the_requests_task_when_its_client_stays() -> None:
    async def main() -> None:
        relayed, loss = Relayed(3), ConnectionLoss()
        await _send_response(
            relayed.response(), {CONNECTION_LOST: loss}, never_receive, relayed.send
        )
        bodies = [m["body"] for m in relayed.sent if m["type"] == "http.response.body"]
        assert bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
        assert relayed.finished == [200, 0]
        assert not loss._callbacks, "nothing left watching the connection"

    asyncio.run(main())


def test_a_lost_connection_ends_the_stream_as_499_and_leaves_the_task_uncancelled() -> None:
    async def main() -> None:
        relayed, loss = Relayed(3, wait=asyncio.Event()), ConnectionLoss()
        scope = {CONNECTION_LOST: loss}
        request = asyncio.create_task(
            _send_response(relayed.response(), scope, never_receive, relayed.send)
        )
        await asyncio.sleep(0.05)
        loss.lost()
        done, _ = await asyncio.wait({request}, timeout=5)
        assert request in done, "the loss did not end the stream"
        assert not request.cancelled() and request.exception() is None
        assert request.cancelling() == 0
        assert relayed.finished == [499, 0] and relayed.engine_closed

    asyncio.run(main())


def test_a_stream_whose_client_went_before_it_began_is_cancelled_by_the_watcher() -> None:
    async def main() -> None:
        relayed, loss = Relayed(3, wait=asyncio.Event()), ConnectionLoss()
        loss.lost()

        async def gone() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        scope = {CONNECTION_LOST: loss}
        await asyncio.wait_for(_send_response(relayed.response(), scope, gone, relayed.send), 5)
        assert relayed.finished == [499, 0] and relayed.engine_closed

    asyncio.run(main())


def test_cancelling_the_requests_task_itself_still_cancels_it() -> None:
    async def main() -> None:
        relayed, loss = Relayed(3, wait=asyncio.Event()), ConnectionLoss()
        scope = {CONNECTION_LOST: loss}
        task = asyncio.create_task(
            _send_response(relayed.response(), scope, never_receive, relayed.send)
        )
        await asyncio.sleep(0.05)
        task.cancel()  # a server shutting down, say: not the client's going
        with pytest.raises(asyncio.CancelledError):
            await task
        assert relayed.finished[:1] == [499] and not loss._callbacks

    asyncio.run(main())


@pytest.mark.parametrize("watched", [True, False])
def test_a_relay_that_fails_still_ends_its_exchange(watched: bool) -> None:
    async def main() -> None:
        relayed = Relayed(3)

        async def broken_send(message: dict[str, Any]) -> None:
            if message.get("body"):
                raise RuntimeError("a bug in the send path")

        scope = {CONNECTION_LOST: ConnectionLoss()} if watched else {}
        with pytest.raises(RuntimeError, match="a bug in the send path"):
            await _send_response(relayed.response(), scope, never_receive, broken_send)
        assert relayed.finished[-1:] == [0], "the response's background task ran"

    asyncio.run(main())


def test_a_request_body_reaches_the_app_whole_in_one_piece_or_many() -> None:
    """OneSendHttpProtocol.on_body keeps a first piece uncopied: bodies sent whole, in pieces
    with pauses between (each a separate read), and past uvicorn's 64 KiB high-water mark
    (reading paused and resumed) reach the app whole and in order."""
    rng = random.Random(7)
    small = bytes(rng.randrange(256) for _ in range(7000))
    large = rng.randbytes(1 << 20)

    async def post_raw(port: int, body: bytes, pieces: int, path: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (path, len(body))
        writer.write(head)
        step = -(-len(body) // pieces)
        for start in range(0, len(body), step):
            writer.write(body[start : start + step])
            await writer.drain()
            await asyncio.sleep(0.02)
        answer = await reader.read(1 << 16)
        writer.close()
        return answer.split(b"\r\n\r\n", 1)[1]

    async def main() -> None:
        port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, http=OneSendHttpProtocol, lifespan="off",
            log_config=None, access_log=False,
        )  # fmt: skip
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            for body, pieces in ((small, 1), (small, 5), (large, 1), (large, 7), (b"x", 1)):
                for path in (b"/collect", b"/collect-late"):
                    answer = await post_raw(port, body, pieces, path)
                    digest, _, received = answer.partition(b" ")
                    assert digest.decode() == hashlib.sha256(body).hexdigest(), (pieces, path)
                    if path == b"/collect-late" and len(body) < (1 << 16):
                        assert int(received) == 1  # the pieces joined in the cycle
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)

    asyncio.run(main())
