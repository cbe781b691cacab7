"""The link between the engines of one multi-node replica: one TCP connection per node rank.

A headless vLLM (node rank > 0) does not notice that the head is gone: its workers block
on the head's message queue for good (seen with vLLM 0.32: still running a minute after
rank 0's vLLM exited). So the engines watch each other:

- rank 0's engine listens on the head port before it starts vLLM; every other rank's engine
  connects to it and sends its rank;
- rank 0 closes the link only once its vLLM has exited (after a drain, the requests in
  flight are finished by then), or the kernel closes it when rank 0's engine dies; either
  way the other ranks see end-of-file and stop their headless vLLM;
- the other way round, rank 0 sees at once when a rank's engine is gone and fails the
  replica instead of waiting for vLLM to time out on a missing worker.

TCP keepalive (about 25 s) covers a node that vanishes without closing anything.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class HeadLink:
    """Rank 0's end: accepts the other ranks and reports one that goes away."""

    def __init__(self, port: int, on_lost: Callable[[int], None], host: str = "") -> None:
        self._on_lost = on_lost
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._ranks: dict[socket.socket, int] = {}
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="head-link", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(r for r in self._ranks.values() if r >= 0)

    def _run(self) -> None:
        buffers: dict[socket.socket, bytes] = {}
        while not self._closing.is_set():
            try:
                events = self._selector.select(timeout=0.2)
            except (OSError, ValueError):  # closed under us
                return
            for key, _ in events:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    try:
                        conn, peer = self._listener.accept()
                    except OSError:
                        continue
                    _keepalive(conn)
                    conn.setblocking(False)
                    with self._lock:
                        self._ranks[conn] = -1
                    buffers[conn] = b""
                    self._selector.register(conn, selectors.EVENT_READ, peer)
                    continue
                try:
                    data = sock.recv(64)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data and self._ranks.get(sock) == -1:
                    buffers[sock] += data
                    line, sep, _ = buffers[sock].partition(b"\n")
                    if sep and line.strip().isdigit():
                        with self._lock:
                            self._ranks[sock] = int(line)
                        log.info("node rank %s's engine joined from %s", int(line), key.data[0])
                        continue
                    if not sep and len(buffers[sock]) < 32:
                        continue
                    data = b""  # not an engine of this replica: drop it
                if data:
                    continue
                self._selector.unregister(sock)
                sock.close()
                buffers.pop(sock, None)
                with self._lock:
                    rank = self._ranks.pop(sock, -1)
                # Only a rank that introduced itself counts (a port scan does not).
                if rank >= 0 and not self._closing.is_set():
                    self._on_lost(rank)

    def close(self) -> None:
        """Tell every other rank that the head is gone."""
        self._closing.set()
        self._thread.join(2)
        with self._lock:
            conns = list(self._ranks)
            self._ranks.clear()
        for conn in [self._listener, *conns]:
            with contextlib.suppress(OSError):
                conn.close()
        with contextlib.suppress(OSError, ValueError):
            self._selector.close()


class WorkerLink:
    """A rank > 0's end: connected to rank 0's engine until the head goes away."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        rank: int,
        *,
        timeout_s: float,
        keep_trying: Callable[[], bool] = lambda: True,
    ) -> WorkerLink:
        """Connect to the head, retrying while it is not listening yet (it starts at the
        same time) for up to `timeout_s`, or until `keep_trying()` says stop.
        Raises ConnectionError naming the address."""
        deadline = time.monotonic() + timeout_s
        last: OSError | None = None
        while keep_trying() and time.monotonic() < deadline:
            try:
                sock = socket.create_connection((host, port), timeout=5)
            except OSError as err:
                last = err
                time.sleep(0.5)
                continue
            if sock.getsockname() == sock.getpeername():
                # TCP self-connect: with nobody listening yet on a port of this host, the
                # kernel may pick that very port as the source port and connect to itself.
                sock.close()
                last = ConnectionRefusedError(f"connected to itself on port {port}")
                time.sleep(0.5)
                continue
            _keepalive(sock)
            sock.sendall(f"{rank}\n".encode())
            sock.settimeout(None)
            return cls(sock)
        raise ConnectionError(
            f"cannot reach the head's engine at {host}:{port} within {timeout_s:g}s ({last})"
        )

    def head_gone(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for the head to close the link; True once it has."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            if not sel.select(timeout=wait_s):
                return False
        try:
            return self._sock.recv(64) == b""
        except OSError:
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
