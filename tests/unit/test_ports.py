import random
import socket

import pytest

from hpcserve.ports import (
    DEFAULT_EPHEMERAL,
    candidate_range,
    ephemeral_range,
    free_ports,
    parse_port_range,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32768\t60999\n", (32768, 60999)),
        ("1024 65535", (1024, 65535)),
        ("", None),
        ("32768", None),
        ("a b", None),
        ("60999 32768", None),
        ("0 100", None),
        ("1 70000", None),
    ],
)
def test_parse_port_range(text: str, expected: tuple[int, int] | None) -> None:
    assert parse_port_range(text) == expected


@pytest.mark.parametrize(
    ("ephemeral", "expected"),
    [
        (DEFAULT_EPHEMERAL, range(10000, 32768)),
        ((10500, 60999), range(61000, 65536)),  # no room below: above
        ((10500, 65000), range(10000, 65536)),  # no room anywhere: everything
    ],
)
def test_candidate_range_avoids_the_ephemeral_range(
    ephemeral: tuple[int, int], expected: range
) -> None:
    assert candidate_range(ephemeral) == expected


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ports = free_ports(5, "127.0.0.1", rng=random.Random(7))
    assert len(set(ports)) == 5
    low, high = ephemeral_range()
    for port in ports:
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out() -> None:
    rng = random.Random(3)
    first = free_ports(1, "127.0.0.1", rng=random.Random(3))[0]
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        assert first not in free_ports(1, "127.0.0.1", rng=rng)
