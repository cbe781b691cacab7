"""tests/ports.py: the ports every test and benchmark server binds."""

import random
import re
import socket

import pytest

from hpcserve.ports import ephemeral_range
from tests.ports import SLURM_BLOCKS, free_port, free_ports, pick_ports


def test_ports_come_from_below_the_ephemeral_range_and_bind() -> None:
    low, high = ephemeral_range()
    for port in free_ports(20):
        assert not low <= port <= high
        assert port not in SLURM_BLOCKS
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_is_never_handed_out_twice_in_a_process() -> None:
    # The servers these ports are for bind later; until then a bind check cannot tell
    # them from free ports, so the helper has to remember what it gave.
    ports = [free_port() for _ in range(300)] + free_ports(50)
    assert len(set(ports)) == len(ports)


def test_a_bound_port_or_one_handed_out_is_skipped() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        pool = range(busy, busy + 1)
        with pytest.raises(OSError, match=re.escape(f"no 1 free TCP ports left in {pool}")):
            pick_ports(1, pool, set(), random.Random(1))
    taken: set[int] = set()
    first = pick_ports(1, range(busy, busy + 1), taken, random.Random(1))
    assert first == [busy] and taken == {busy}
    with pytest.raises(OSError, match="1 handed out"):
        pick_ports(1, range(busy, busy + 1), taken, random.Random(1))
