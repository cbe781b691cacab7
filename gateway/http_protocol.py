"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, with each response's
head held until its body's first bytes so that a whole answer leaves in one send.

uvicorn writes a response's status line and headers to the socket when the app sends
``http.response.start`` and the body when it sends ``http.response.body``: two sends, two
TCP segments, for every answer, where the second follows the first a few microseconds
later in the same event-loop iteration. On loopback and in a VM a send costs a kernel TCP
path on both sides, a large share of a relayed request's CPU (docs/benchmarks.md). Here
the head is held and written with the next write, or at the end of the loop iteration
when none comes in it (a stream whose first event is still at the engine), so nothing is
delayed past the iteration that produced it. Writes keep their order; closing the
connection writes what is held first.

It also tells a streaming app that its client has gone without a task of its own watching
`receive()` for http.disconnect: each request's scope holds the connection's
ConnectionLoss under CONNECTION_LOST.

And a request body that arrives in one piece reaches the app as the bytes the parser made:
uvicorn appends every piece to a bytearray and copies that into new bytes on `receive()`,
two copies of a chat body (docs/benchmarks.md, issue 23's twelfth pass).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# What uvicorn's head write starts with (its STATUS_LINE table); a body that happens to start
# so is held the same way, still in order.
_HEAD = b"HTTP/1.1 "
# The scope key of a request's ConnectionLoss.
CONNECTION_LOST = "hpcserve.connection_lost"


class ConnectionLoss:
    """A connection's loss as its requests see it: `happened`, and callbacks called once
    when it happens."""

    __slots__ = ("_callbacks", "happened")

    def __init__(self) -> None:
        self.happened = False
        self._callbacks: set[Callable[[], None]] = set()

    def watch(self, callback: Callable[[], None]) -> None:
        self._callbacks.add(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def lost(self) -> None:
        self.happened = True
        callbacks = list(self._callbacks)
        self._callbacks.clear()
        for callback in callbacks:
            callback()


class OneSendTransport:
    """A connection's transport that holds a response head for the next write (see the module
    docstring); everything else is the real transport's."""

    __slots__ = ("_held", "_loop", "_real")

    def __init__(self, real: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._real = real
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._real.writelines((held, data))
        elif data[: len(_HEAD)] == _HEAD:
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._real.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._real.is_closing():
                self._real.write(held)

    def writelines(self, chunks: Any) -> None:
        self._flush()
        self._real.writelines(chunks)

    def close(self) -> None:
        self._flush()
        self._real.close()

    def is_closing(self) -> bool:
        return self._real.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._real.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class OneSendHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a OneSendTransport (pass the class as
    uvicorn.Config(http=...))."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._loss = ConnectionLoss()
        wrapped = OneSendTransport(cast(asyncio.Transport, transport), self.loop)
        super().connection_made(cast(asyncio.Transport, wrapped))

    def on_body(self, body: bytes) -> None:
        """uvicorn's, keeping a first piece as it came: the cycle's `receive()` passes on
        `bytes(cycle.body)`, which is that piece itself, uncopied. A second piece before
        `receive()` took the first joins it in a bytearray, as uvicorn's does."""
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        held = cast("bytes | bytearray", cycle.body)
        if not held:
            cycle.body = body  # type: ignore[assignment]
        elif type(held) is bytes:
            cycle.body = bytearray(held)
            cycle.body += body
        else:
            held += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CONNECTION_LOST] = self._loss  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._loss.lost()
