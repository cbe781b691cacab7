"""A router restart forgets nothing of the quota book: gateways re-send their whole window
when the book's epoch changes (router/quota_book.py, gateway/quota.py), fake clock."""

import pytest

from hpcserve.config import TenantConfig
from hpcserve.contracts import protocol as p
from hpcserve.gateway.auth import Tenant
from hpcserve.gateway.quota import QuotaExceeded, QuotaGate
from hpcserve.router.quota_book import QuotaBook, Window


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


ACME = Tenant("acme", TenantConfig(name="acme", requests_per_min=4, tokens_per_min=100))


def sync(gate: QuotaGate, book: QuotaBook, now: float) -> None:
    usage = gate.report(keepalive=True) or []
    gate.apply(book.report(p.QuotaReport(1, gate.gateway_id, usage), now))


def test_a_window_restored_from_its_ages_keeps_when_usage_leaves_it() -> None:
    window = Window()
    window.add(100.5, 1, 10)
    window.add(130.2, 2, 0)
    ages = window.ages(140.0)
    assert [(round(a.age_s), a.requests, a.tokens) for a in ages] == [(40, 1, 10), (10, 2, 0)]
    # On another clock (the new router's), the same usage at the same ages.
    restored = Window.restored(5000.0, ages)
    assert (restored.requests, restored.tokens) == (3, 10)
    assert restored.frees_in_s(5000.0) == pytest.approx(20.0, abs=1.0)
    restored.expire(5021.0)
    assert (restored.requests, restored.tokens) == (2, 0)
    assert Window.restored(5000.0, [p.UsageSlot(75.0, 5, 5)]).requests == 0  # too old


def test_every_answer_carries_the_books_epoch_and_a_new_book_has_a_new_one() -> None:
    first, second = QuotaBook(), QuotaBook()
    assert first.epoch and first.epoch != second.epoch
    assert first.report(p.QuotaReport(1, "g1"), 0.0).epoch == first.epoch


def test_limits_hold_across_a_router_restart_under_two_gateways() -> None:
    clock = Clock()
    book = QuotaBook()
    one, two = QuotaGate("g1", clock=clock), QuotaGate("g2", clock=clock)
    for gate in (one, two):
        sync(gate, book, clock.now)
        gate.admit(ACME)
        gate.admit(ACME)
        gate.finish(ACME, 20)
        gate.finish(ACME, 20)
    for gate in (one, two, one):
        sync(gate, book, clock.now)
    with pytest.raises(QuotaExceeded, match="requests_per_min"):
        one.admit(ACME)

    clock.now += 5
    book = QuotaBook()  # the router restarted: an empty book under a new epoch
    # First contact: deltas (none), answered under the new epoch -> whole windows next.
    for gate in (one, two):
        sync(gate, book, clock.now)
    sent = one.report()
    assert sent is not None and sent[0].window is not None
    assert sum(s.requests for s in sent[0].window) == 2
    one.apply(book.report(p.QuotaReport(2, "g1", sent), clock.now))
    sync(two, book, clock.now)
    sync(one, book, clock.now)
    # The minute's 4 requests and 80 tokens are known again, on either gateway.
    for gate in (one, two):
        with pytest.raises(QuotaExceeded, match="requests_per_min"):
            gate.admit(ACME)
    (totals,) = book.others("nobody", clock.now)
    assert (totals.requests, totals.tokens) == (4, 80)
    # And they leave the window when they would have: a minute after they were used.
    clock.now += 56
    sync(one, book, clock.now)
    sync(two, book, clock.now)
    one.admit(ACME)


def test_whole_windows_that_got_no_answer_are_sent_again_and_deltas_are_not_doubled() -> None:
    clock = Clock()
    book = QuotaBook()
    gate = QuotaGate("g1", clock=clock)
    gate.admit(ACME)
    sync(gate, book, clock.now)  # deltas; the epoch is new to the gate
    gate.admit(ACME)
    sent = gate.report()
    assert sent is not None and sent[0].window is not None
    gate.unsent()  # the router did not answer
    again = gate.report()
    assert again is not None and again[0].window is not None
    gate.apply(book.report(p.QuotaReport(3, "g1", again), clock.now))
    (totals,) = book.others("g2", clock.now)
    assert totals.requests == 2  # the first delta is inside the window: counted once
    assert gate.report() is None  # back to deltas, nothing new
