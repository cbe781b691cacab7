"""A TCP proxy on loopback, in the test's event loop, that misbehaves as a network does:
it can split what it forwards into small pieces, refuse connections, and cut every
connection at once, losing what was on its way (a blip), also as soon as given bytes pass."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket

from tests.ports import free_port


class TcpProxy:
    """Forwards `127.0.0.1:port` to `target_port`. `pieces`: forward in random pieces of at
    most this many bytes, each its own write (partial reads on the other side); 0: as read.
    `refusing`: new connections are closed at once. `blip_on`: the first time the client
    side sends bytes containing it, they are dropped and every connection is cut."""

    def __init__(self, target_port: int, *, pieces: int = 0, seed: int = 0) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.pieces = pieces
        self.refusing = False
        self.blip_on = b""
        self.blips = 0
        self.connections = 0
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def cut(self) -> None:
        """Every connection reset at once, whatever was on its way lost."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        for w in (writer, up_writer):
            w.transport.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, upstream=True)),
            asyncio.create_task(self._pump(up_reader, writer, upstream=False)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
            self._tasks.discard(task)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if upstream and self.blip_on and self.blip_on in data:
                    self.blip_on = b""
                    self.blips += 1
                    self.cut()
                    return
                while data and self.pieces:
                    size = self._rng.randint(1, self.pieces)
                    writer.write(data[:size])
                    data = data[size:]
                    await writer.drain()
                    await asyncio.sleep(0)
                if data:
                    writer.write(data)
                    await writer.drain()
