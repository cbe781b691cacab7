"""The link between the engines of a multi-node replica, over loopback TCP."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hpcserve.engine_launch.lifeline import HeadLink, WorkerLink
from tests.ports import free_port


def wait_until(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def head() -> Iterator[tuple[HeadLink, list[int]]]:
    lost: list[int] = []
    link = HeadLink(0, on_lost=lost.append, host="127.0.0.1")
    yield link, lost
    link.close()


def test_ranks_join_and_see_the_head_go(head: tuple[HeadLink, list[int]]) -> None:
    link, lost = head
    workers = [WorkerLink.connect("127.0.0.1", link.port, rank, timeout_s=60) for rank in (1, 2)]
    wait_until(lambda: link.ranks() == [1, 2])
    assert not any(w.head_gone(0.1) for w in workers)
    link.close()
    assert all(w.head_gone(30) for w in workers)
    assert lost == [], "closing the head is not a lost rank"
    for w in workers:
        w.close()


def test_the_head_learns_a_rank_is_gone(head: tuple[HeadLink, list[int]]) -> None:
    link, lost = head
    worker = WorkerLink.connect("127.0.0.1", link.port, 3, timeout_s=60)
    wait_until(lambda: link.ranks() == [3])
    worker.close()
    wait_until(lambda: lost == [3])
    assert link.ranks() == []


def test_a_stranger_is_not_a_rank(head: tuple[HeadLink, list[int]]) -> None:
    link, lost = head
    with socket.create_connection(("127.0.0.1", link.port)) as probe:
        probe.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64)
    with socket.create_connection(("127.0.0.1", link.port)):
        pass
    time.sleep(0.5)
    assert lost == [] and link.ranks() == []


def test_worker_waits_for_a_head_that_starts_later() -> None:
    port = free_port()  # not ephemeral: a retried connect to one can end up joined to itself
    lost: list[int] = []
    started: list[HeadLink] = []
    timer = threading.Timer(
        1.0, lambda: started.append(HeadLink(port, on_lost=lost.append, host="127.0.0.1"))
    )
    timer.start()
    try:
        worker = WorkerLink.connect("127.0.0.1", port, 1, timeout_s=60)
        wait_until(lambda: bool(started) and started[0].ranks() == [1])
        worker.close()
    finally:
        timer.join()
        for link in started:
            link.close()


def test_worker_gives_up_naming_the_head() -> None:
    port = free_port()
    with pytest.raises(
        ConnectionError, match=f"cannot reach the head's engine at 127.0.0.1:{port}"
    ):
        WorkerLink.connect("127.0.0.1", port, 1, timeout_s=1)
    with pytest.raises(ConnectionError):
        WorkerLink.connect("127.0.0.1", port, 1, timeout_s=60, keep_trying=lambda: False)
