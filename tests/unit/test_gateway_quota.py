"""Tenant limits: the router's quota book and each gateway's gate, driven by a fake clock."""

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


def tenant(**limits: int) -> Tenant:
    return Tenant("acme", TenantConfig(name="acme", **limits))


def test_window_forgets_usage_older_than_a_minute() -> None:
    window = Window()
    window.add(100.2, 1, 10)
    window.add(100.9, 1, 5)
    window.add(130.0, 1, 0)
    assert (window.requests, window.tokens) == (3, 15)
    assert window.frees_in_s(130.0) == pytest.approx(30.0)
    window.expire(160.0)
    assert (window.requests, window.tokens) == (1, 0)
    window.expire(190.0)
    assert (window.requests, window.tokens) == (0, 0) and window.frees_in_s(190.0) == 0


@pytest.mark.parametrize(
    ("limits", "limit"),
    [
        ({"requests_per_min": 3}, "requests_per_min"),
        ({"max_concurrent": 3}, "max_concurrent"),
    ],
)
def test_gate_refuses_the_request_over_the_limit(limits: dict[str, int], limit: str) -> None:
    gate = QuotaGate("g1", clock=Clock())
    for _ in range(3):
        gate.admit(tenant(**limits))
    with pytest.raises(QuotaExceeded) as err:
        gate.admit(tenant(**limits))
    assert err.value.status == 429 and err.value.limit == limit
    assert err.value.retry_after_s is not None and err.value.retry_after_s >= 1


def test_concurrency_frees_on_finish_and_requests_on_the_minute() -> None:
    clock = Clock()
    gate = QuotaGate("g1", clock=clock)
    t = tenant(max_concurrent=1, requests_per_min=2)
    gate.admit(t)
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        gate.admit(t)
    gate.finish(t, 0)
    gate.admit(t)
    gate.finish(t, 0)
    with pytest.raises(QuotaExceeded, match="requests_per_min") as err:
        gate.admit(t)
    assert err.value.retry_after_s == 60
    clock.now += 61
    gate.admit(t)


def test_tokens_are_charged_after_the_fact() -> None:
    gate = QuotaGate("g1", clock=Clock())
    t = tenant(tokens_per_min=100)
    gate.admit(t)
    gate.finish(t, 99)
    gate.admit(t)  # under the limit when it arrived
    gate.finish(t, 50)
    with pytest.raises(QuotaExceeded, match="tokens_per_min"):
        gate.admit(t)


def test_a_refund_undoes_the_admit() -> None:
    gate = QuotaGate("g1", clock=Clock())
    t = tenant(requests_per_min=1, max_concurrent=1)
    gate.admit(t)
    gate.refund(t)
    gate.admit(t)


def test_two_gateways_share_limits_through_the_book() -> None:
    clock = Clock()
    book = QuotaBook()
    one, two = QuotaGate("g1", clock=clock), QuotaGate("g2", clock=clock)
    t = tenant(requests_per_min=4, max_concurrent=3)

    def sync(gate: QuotaGate) -> None:
        usage = gate.report(keepalive=True)
        assert usage is not None
        gate.apply(book.report(p.QuotaReport(1, gate.gateway_id, usage), clock.now))

    one.admit(t)
    one.admit(t)
    two.admit(t)
    sync(one)
    sync(two)
    sync(one)
    # Three running across the two gateways: the limit of 3 holds on either.
    with pytest.raises(QuotaExceeded, match="max_concurrent"):
        one.admit(t)
    one.finish(t, 0)
    one.finish(t, 0)
    sync(one)
    sync(two)
    two.admit(t)  # the fourth request of the minute
    sync(two)
    sync(one)
    with pytest.raises(QuotaExceeded, match="requests_per_min"):
        one.admit(t)


def test_a_silent_gateways_in_flight_is_dropped_but_its_usage_stays() -> None:
    clock = Clock()
    book = QuotaBook(stale_after_s=5)
    book.report(p.QuotaReport(1, "gone", [p.TenantUsage("acme", 3, 30, 2)]), clock.now)
    (totals,) = book.others("alive", clock.now)
    assert (totals.requests, totals.tokens, totals.in_flight) == (3, 30, 2)
    clock.now += 10
    (totals,) = book.others("alive", clock.now)
    assert (totals.requests, totals.tokens, totals.in_flight) == (3, 30, 0)
    clock.now += 60
    assert book.others("alive", clock.now) == []


def test_the_router_away_means_local_limits_and_deltas_resent() -> None:
    clock = Clock()
    gate = QuotaGate("g1", clock=clock, stale_after_s=5)
    t = tenant(requests_per_min=3)
    gate.apply(p.QuotaTotals(1, [p.TenantTotals("acme", requests=3)]))
    with pytest.raises(QuotaExceeded):
        gate.admit(t)
    clock.now += 6  # the others' totals are stale: only this gateway's own usage counts
    gate.admit(t)
    sent = gate.report()
    assert sent == [p.TenantUsage("acme", 1, 0, 1)]
    gate.unsent()
    assert gate.report() == [p.TenantUsage("acme", 1, 0, 1)]


def test_quota_messages_round_trip_with_tags_of_their_own() -> None:
    report = p.QuotaReport(1, "g1", [p.TenantUsage("acme", 2, 30, 1)])
    totals = p.QuotaTotals(1, [p.TenantTotals("acme", 2, 30, 1, 12.5)])
    assert p.routing_message_decoder.decode(p.encode(report)) == report
    assert p.routing_reply_decoder.decode(p.encode(totals)) == totals
    routing = [*p.RoutingMessage.__args__, *p.RoutingReply.__args__]  # type: ignore[attr-defined]
    registry = [*p.RegistryMessage.__args__, *p.RegistryReply.__args__]  # type: ignore[attr-defined]
    tags = [s.__struct_config__.tag for s in routing + registry]
    assert len(set(tags)) == len(tags)
