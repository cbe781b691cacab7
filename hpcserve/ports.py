"""Ports for the sockets an engine's processes bind later (vLLM's HTTP server, its KV-event
publisher and replay socket, torch.distributed's rendezvous).

Asking the kernel for port 0 and closing the socket hands out a port from the ephemeral
range, the same range every outgoing connection on the host draws from. vLLM binds its
KV-event sockets only after the model has loaded, a minute or more later, and by then an
outgoing connection (another engine's ZeroMQ or HTTP client) may hold that port: vLLM then
dies with "Address already in use". So ports come from below the ephemeral range, where
outgoing connections never land, chosen at random and checked free when chosen.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

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


def free_ports(count: int, host: str = "", rng: random.Random | None = None) -> list[int]:
    """`count` distinct ports free on `host` now, outside the ephemeral range."""
    rng = rng or random.Random()
    bind_host = "" if host in ("0.0.0.0", "*") else host
    pool = candidate_range(ephemeral_range())
    chosen: list[int] = []
    for _ in range(200 * count):
        port = rng.choice(pool)
        if port not in chosen and _is_free(bind_host, port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise OSError(f"no {count} free TCP ports found on {host or 'this host'} in {pool}")


def free_port(host: str = "") -> int:
    return free_ports(1, host)[0]
