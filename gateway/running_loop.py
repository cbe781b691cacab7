"""The running event loop, found again without a system call.

`asyncio.get_running_loop()` (and every asyncio call that looks the loop up: `create_task`,
`ensure_future`, `Future()`, `sleep`) calls getpid(2) each time in CPython 3.11, to notice a
fork; a request's path asks for it several times. A component that remembers the loop it
runs on checks instead that this loop runs in this thread: only one loop runs in a thread at
a time, so that one is the running loop.
"""

from __future__ import annotations

import asyncio
from threading import get_ident


class RunningLoop:
    """The loop this component last ran on and its thread; `get()` is the running loop."""

    __slots__ = ("_thread", "loop")

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    def get(self) -> asyncio.AbstractEventLoop:
        """The running loop (raises RuntimeError outside one, as asyncio does)."""
        loop = self.loop
        if loop is not None and get_ident() == self._thread and loop.is_running():
            return loop
        loop = self.loop = asyncio.get_running_loop()
        self._thread = get_ident()
        return loop
