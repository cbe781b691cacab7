"""router/in_flight_book.py: counts booked per routing connection."""

import pytest

from hpcserve.router.in_flight_book import InFlightBook

A, B = b"\x00\x00\x00\x01", b"\x00\x00\x00\x02"


def book(*entries: tuple[bytes, str, str]) -> InFlightBook:
    b = InFlightBook()
    for peer, replica, model in entries:
        b.booked(peer, replica, model)
    return b


@pytest.mark.parametrize(
    ("entries", "release", "expected", "left"),
    [
        ([(A, "r1", "m")], (A, "r1", "m"), "m", 0),
        ([(A, "r1", "m"), (A, "r1", "m")], (A, "r1", "m"), "m", 1),
        ([(A, "r1", "docs-a")], (A, "r1", ""), "docs-a", 0),  # a late reply's: any model
        ([(A, "r1", "docs-a")], (A, "r1", "m"), "docs-a", 0),  # not booked as said: any
        ([(A, "r1", "m")], (B, "r1", "m"), None, 1),  # another connection's: not released
        ([(A, "r1", "m")], (A, "r2", "m"), None, 1),  # another replica's
        ([], (A, "r1", "m"), None, 0),
    ],
)
def test_a_release_undoes_only_what_its_connection_booked(
    entries: list[tuple[bytes, str, str]],
    release: tuple[bytes, str, str],
    expected: str | None,
    left: int,
) -> None:
    b = book(*entries)
    assert b.release(*release) == expected
    assert b.total() == left


def test_a_dropped_connection_hands_back_one_entry_per_request_and_is_forgotten() -> None:
    b = book((A, "r1", "m"), (A, "r1", "m"), (A, "r2", "docs-a"), (B, "r1", "m"))
    assert sorted(b.dropped(A)) == [("r1", "m"), ("r1", "m"), ("r2", "docs-a")]
    assert b.total() == 1
    assert b.dropped(A) == []
    assert b.release(A, "r1", "m") is None
    assert b.release(B, "r1", "m") == "m" and b.total() == 0
