"""gateway/running_loop.py (the running loop without asyncio's getpid per lookup) and
gateway/request_ids.py (request ids drawn from the kernel 256 at a time)."""

from __future__ import annotations

import asyncio
import os
import re
import threading

import pytest

from hpcserve.gateway import running_loop
from hpcserve.gateway.request_ids import new_request_id
from hpcserve.gateway.running_loop import RunningLoop


def test_running_loop_is_the_running_one_and_asks_asyncio_once_per_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[asyncio.AbstractEventLoop] = []
    real = asyncio.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        asked.append(real())
        return asked[-1]

    monkeypatch.setattr(running_loop.asyncio, "get_running_loop", counting)
    cached = RunningLoop()

    async def twice() -> asyncio.AbstractEventLoop:
        assert cached.get() is real()
        assert cached.get() is real()
        return real()

    first = asyncio.run(twice())
    second = asyncio.run(twice())  # a new loop in the same thread: found again
    assert first is not second
    assert asked == [first, second]

    seen: list[asyncio.AbstractEventLoop] = []
    thread = threading.Thread(target=lambda: seen.append(asyncio.run(twice())))
    thread.start()
    thread.join()
    assert len(asked) == 3 and asked[2] is seen[0] not in (first, second)


def test_running_loop_outside_a_loop_raises_as_asyncio_does() -> None:
    cached = RunningLoop()
    asyncio.run(asyncio.sleep(0))
    with pytest.raises(RuntimeError):
        cached.get()

    async def bind() -> None:
        cached.get()

    asyncio.run(bind())
    with pytest.raises(RuntimeError):  # the loop it remembers has stopped
        cached.get()


def test_request_ids_are_24_hex_and_distinct() -> None:
    ids = [new_request_id() for _ in range(5000)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_never_hands_out_its_parents_ids() -> None:
    new_request_id()  # the parent holds ids drawn and not used yet
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then gone
        os.close(read)
        os.write(write, " ".join(new_request_id() for _ in range(10)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {new_request_id() for _ in range(300)}
    assert len(child) == 10
    assert not child & parent
