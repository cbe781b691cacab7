"""The gateway's HTTP protocol (gateway/http_protocol.py): a response head is held for the
next write and leaves with it in one send, or alone at the end of the loop iteration; on a
real socket pair, then through a real uvicorn server with the httpx client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import uvicorn

from hpcserve.gateway.http_protocol import OneSendHttpProtocol, OneSendTransport
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
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await app.gate.wait()  # type: ignore[attr-defined]
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    message = await receive()
    echo = message.get("body", b"") or b"empty"
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(echo))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": echo})


def test_through_uvicorn_answers_streams_and_errors_are_whole() -> None:
    async def main() -> None:
        app.gate = asyncio.Event()  # type: ignore[attr-defined]
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
