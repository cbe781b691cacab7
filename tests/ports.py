"""Ports for the servers a test or benchmark starts.

A port from the kernel's port 0 comes from the ephemeral range: any outgoing connection on the
host (a ZeroMQ reconnect, an HTTP client, Slurm) may take it between the moment it is chosen
and the moment the server binds it. These come from below that range, where outgoing
connections never land (hpcserve.ports draws from the same range for engines), at random and
checked free, and this process never hands out the same port twice: a server that has not
bound yet cannot be told apart from a free port by a bind check. For the same reason each is
reserved host-wide for the life of this process (hpcserve/port_reservations.py), as engines
reserve theirs: an engine of a test cluster on this host never takes a test server's port
before it binds, nor a test server an engine's.
"""

from __future__ import annotations

import atexit
import random
import socket
import threading

from hpcserve.port_reservations import PortReservation, try_reserve
from hpcserve.ports import candidate_range, ephemeral_range

# tests/integration/slurm_helpers.free_port_block hands out Slurm daemons' ports from here.
SLURM_BLOCKS = range(26817, 27817 + 10)

_handed_out: set[int] = set()
_reserved: list[PortReservation] = []
_lock = threading.Lock()
_rng = random.Random()


def _bindable(port: int) -> bool:
    """Free on every address (a server may bind 0.0.0.0, 127.0.0.1 or ZeroMQ's '*')."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def pick_ports(count: int, pool: range, taken: set[int], rng: random.Random) -> list[int]:
    """`count` ports from `pool` that are not in `taken` and bind now; adds them to `taken`."""
    chosen: list[int] = []
    for _ in range(200 * count):
        port = rng.choice(pool)
        if port in taken or port in SLURM_BLOCKS:
            continue
        reservation = try_reserve(port)
        if reservation is None:
            continue
        if not _bindable(port):
            reservation.release()
            continue
        _reserved.append(reservation)
        taken.add(port)
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise OSError(f"no {count} free TCP ports left in {pool} ({len(taken)} handed out)")


@atexit.register
def _release_all() -> None:
    for reservation in _reserved:
        reservation.release()


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports, free now, outside the ephemeral range, never handed out
    before by this process."""
    with _lock:
        return pick_ports(count, candidate_range(ephemeral_range()), _handed_out, _rng)


def free_port() -> int:
    """A TCP port free now, outside the ephemeral range, never handed out before by this
    process."""
    return free_ports(1)[0]
