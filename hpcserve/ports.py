"""Ports for the sockets an engine's processes bind later (vLLM's HTTP server, its KV-event
publisher and replay socket, torch.distributed's rendezvous).

Asking the kernel for port 0 and closing the socket hands out a port from the ephemeral
range, the same range every outgoing connection on the host draws from. vLLM binds its
KV-event sockets only after the model has loaded, a minute or more later, and by then an
outgoing connection (another engine's ZeroMQ or HTTP client) may hold that port: vLLM then
dies with "Address already in use". So ports come from below the ephemeral range, where
outgoing connections never land, chosen at random and checked free when chosen.

Checked free is not enough where the port is bound later by another process: two engines on
one host could both choose it before either binds. `reserve_ports` therefore also reserves
each port host-wide (hpcserve/port_reservations.py) until the caller releases it or exits;
`free_ports` skips ports others have reserved.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from hpcserve.port_reservations import PortReservation, is_reserved, sweep, try_reserve

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range; also the fallback where the file cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)
# Never hand out well-known or commonly configured service ports.
LOWEST = 10000


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``"32768\\t60999\\n"`` -> (32768, 60999); None for anything else."""
    parts = text.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    low, high = int(parts[0]), int(parts[1])
    if not 1 <= low <= high <= 65535:
        return None
    return low, high


def candidate_range(ephemeral: tuple[int, int]) -> range:
    """The ports to draw from: below the ephemeral range if there is room, else above it."""
    low, high = ephemeral
    if low - LOWEST >= 1000:
        return range(LOWEST, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return range(LOWEST, 65536)


def ephemeral_range() -> tuple[int, int]:
    try:
        return parse_port_range(EPHEMERAL_RANGE_FILE.read_text()) or DEFAULT_EPHEMERAL
    except OSError:
        return DEFAULT_EPHEMERAL


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _bind_host(host: str) -> str:
    return "" if host in ("0.0.0.0", "*") else host


def free_ports(
    count: int, host: str = "", rng: random.Random | None = None, directory: Path | None = None
) -> list[int]:
    """`count` distinct ports free on `host` now, outside the ephemeral range, and reserved
    by no process (nothing is reserved: for a server that binds them at once)."""
    rng = rng or random.Random()
    pool = candidate_range(ephemeral_range())
    chosen: list[int] = []
    for _ in range(200 * count):
        port = rng.choice(pool)
        if port in chosen or is_reserved(port, directory):
            continue
        if _is_free(_bind_host(host), port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise OSError(f"no {count} free TCP ports found on {host or 'this host'} in {pool}")


_swept: set[Path | None] = set()


def reserve_ports(
    count: int, host: str = "", rng: random.Random | None = None, directory: Path | None = None
) -> list[PortReservation]:
    """`count` distinct ports free on `host` now, outside the ephemeral range, each reserved
    host-wide for this process until released (or until it exits)."""
    rng = rng or random.Random()
    if directory not in _swept:
        _swept.add(directory)
        sweep(directory)  # what holders that were killed left behind
    pool = candidate_range(ephemeral_range())
    held: list[PortReservation] = []
    for _ in range(200 * count):
        port = rng.choice(pool)
        if any(r.port == port for r in held):
            continue
        reservation = try_reserve(port, directory)
        if reservation is None:
            continue
        # Checked after reserving: no other hpcserve process can take it from here on.
        if not _is_free(_bind_host(host), port):
            reservation.release()
            continue
        held.append(reservation)
        if len(held) == count:
            return held
    for reservation in held:
        reservation.release()
    raise OSError(f"no {count} free, unreserved TCP ports found on {host or 'this host'} in {pool}")


def free_port(host: str = "") -> int:
    return free_ports(1, host)[0]
