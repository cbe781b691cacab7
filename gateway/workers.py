"""Several gateway processes on one port (`gateway.workers`, `hpcserve gateway --workers N`).

Each worker binds `gateway.host:port` itself with SO_REUSEPORT, so the kernel spreads new
connections over the workers' listening sockets (by a hash of the connection's addresses:
no accept() thundering herd, one core's worth of requests per worker). A worker is a whole
gateway: its own routing client and replica view from the router (the one routing view all
of them share is the router's), its own quota ledger synced with the router's quota book
under its own gateway id (router/quota_book.py adds the workers up as it adds up gateways),
its own Batch API runner that takes the runner lock (flock, gateway/batch/lock.py) only when
no other process holds it, and its own prompt cache (warmed by the requests it gets).

The supervisor (this module, the process `hpcserve gateway` started) does no serving: it
checks the address can be bound, starts the workers (spawned, not forked: nothing of the
parent's threads or loops is inherited), restarts one that dies (at most once every
RESTART_S per worker), and on SIGTERM or SIGINT stops them all (SIGTERM, then SIGKILL after
the workers' graceful shutdown time) and returns.

Metrics: each worker also serves on a private socket of its own (an abstract Unix socket
named after the state directory and port), and the worker that gets a scrape of /metrics
asks the others there (`WorkerSet.merged`): one exposition with every worker's series, each
labelled worker="<index>" (sum them by the other labels). A worker that does not answer in
time is left out of that scrape (logged).

Failure mode: a worker that dies drops the connections it held; the others keep serving and
the kernel gives its share of new connections to them until it is back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import os
import signal
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# A worker's /metrics asked with this header answers its own series only (no gathering).
LOCAL_HEADER = "x-hpcserve-worker-local"
GATHER_TIMEOUT_S = 5.0
RESTART_S = 5.0
STOP_GRACE_S = 35.0  # the workers' timeout_graceful_shutdown (gateway/server.py) and margin


def reuseport_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on host:port that other SO_REUSEPORT sockets of this user
    may share."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def worker_address(state_dir: str, host: str, port: int, index: int) -> str:
    """Worker `index`'s private socket: abstract (no file to clean up after a SIGKILL),
    named after the deployment and address so that gateways on one host do not meet."""
    tag = hashlib.sha256(f"{state_dir}\0{host}\0{port}".encode()).hexdigest()[:16]
    return f"\0hpcserve-gateway-{tag}-{index}"


def check_peer_is_us(sock: socket.socket) -> None:
    """An abstract socket has no file and so no permissions: another user could bind a
    worker's name first (or after it died). The metrics token goes only to a peer running
    as this account (SO_PEERCRED); anyone else is an OSError naming its uid."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.geteuid():
        raise PermissionError(f"the socket is held by uid {uid}, not this account's")


def private_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(parts: list[tuple[str, str]]) -> bytes:
    """(worker label, Prometheus text) of each worker as one exposition, every sample
    labelled with its worker."""
    families: dict[str, Metric] = {}
    for worker, text in parts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, "worker": worker}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class WorkerSet:
    """This worker's index and the private sockets of all workers (see the module
    docstring)."""

    def __init__(self, index: int, addresses: list[str], *, tls: bool = False) -> None:
        self.index = index
        self.addresses = addresses
        # With TLS the private sockets speak it too (one uvicorn server serves both); the
        # peer is our own worker on this host's socket, so its certificate is not checked.
        self.tls = tls

    async def merged(self, own: bytes, authorization: str) -> bytes:
        """Every worker's /metrics as one exposition (`own`: this worker's)."""

        async def fetch(index: int, address: str) -> tuple[str, str] | None:
            try:
                text = await asyncio.wait_for(
                    self._get_metrics(address, authorization), GATHER_TIMEOUT_S
                )
            except (OSError, TimeoutError, ValueError) as err:
                log.warning("gateway worker %d left out of /metrics: %s", index, err)
                return None
            return str(index), text

        others = [fetch(i, address) for i, address in enumerate(self.addresses) if i != self.index]
        parts = [(str(self.index), own.decode())]
        parts += [part for part in await asyncio.gather(*others) if part is not None]
        return merge_expositions(sorted(parts, key=lambda part: int(part[0])))

    async def _get_metrics(self, address: str, authorization: str) -> str:
        """GET /metrics over a worker's private socket: one HTTP/1.1 exchange, by hand
        (uvloop's Unix connections take no abstract names; a plain socket does)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, address)
            check_peer_is_us(sock)
        except OSError:
            sock.close()
            raise
        context = None
        if self.tls:
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        reader, writer = await asyncio.open_connection(
            sock=sock, ssl=context, server_hostname="worker" if context else None
        )
        try:
            writer.write(
                f"GET /metrics HTTP/1.1\r\nhost: worker\r\nauthorization: {authorization}\r\n"
                f"{LOCAL_HEADER}: 1\r\nconnection: close\r\n\r\n".encode("latin-1")
            )
            await writer.drain()
            answer = await reader.read()
        finally:
            writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if not status.startswith(b"HTTP/1.1 200"):
            raise ValueError(f"answered {status.decode('latin-1')!r}")
        if b"transfer-encoding: chunked" in head.lower():
            raise ValueError("answered with a chunked body")
        return body.decode()


def run_workers(
    count: int,
    host: str,
    port: int,
    target: Callable[..., None],
    args: tuple[Any, ...],
) -> int:
    """Run `target(*args, index)` in `count` spawned processes until SIGTERM/SIGINT; returns
    the exit status for the supervisor (0 after a stop, 2 when the address cannot be bound).
    `target` must be importable (spawned processes import it by name)."""
    try:
        reuseport_socket(host, port).close()  # taken by something that does not share it?
    except OSError as err:
        log.error("gateway: cannot listen on %s:%d: %s", host, port, err)
        return 2
    context = multiprocessing.get_context("spawn")
    procs: dict[int, BaseProcess] = {}
    started: dict[int, float] = {}
    stopping = False

    def start(index: int) -> None:
        proc = context.Process(target=target, args=(*args, index), name=f"gateway-worker-{index}")
        proc.start()
        procs[index], started[index] = proc, time.monotonic()

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(count):
            start(index)
        log.info("gateway: %d workers on %s:%d (SO_REUSEPORT)", count, host, port)
        while not stopping:
            for index, proc in list(procs.items()):
                if proc.is_alive() or stopping:
                    continue
                wait = started[index] + RESTART_S - time.monotonic()
                if wait > 0:
                    continue  # restarted at most once every RESTART_S
                log.warning(
                    "gateway worker %d (pid %s) exited with %s: starting it again",
                    index,
                    proc.pid,
                    proc.exitcode,
                )
                start(index)
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs.values():
            if proc.is_alive() and proc.pid is not None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("gateway worker pid %s did not stop in time: killing it", proc.pid)
                proc.kill()
                proc.join(5)
        log.info("gateway: workers stopped")
    return 0
