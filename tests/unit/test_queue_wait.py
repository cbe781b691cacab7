"""The router's queue-wait estimate and the queue budget of overflow (router/queue_wait.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from hpcserve.contracts import protocol as p
from hpcserve.contracts.protocol import OVER_QUEUE_BUDGET
from hpcserve.router import queue_wait
from hpcserve.router.queue_wait import ServiceTracker, within_budget
from hpcserve.router.registry import Registry
from hpcserve.router.server import RouterServer
from tests.routers import loopback_router_config, running_router


def tracker(slots: int = 0, interval: float | None = None) -> ServiceTracker:
    t = ServiceTracker()
    t.slots, t.interval = slots, interval
    return t


@pytest.mark.parametrize(
    ("slots", "interval", "in_flight", "running", "waiting", "expected"),
    [
        (0, None, 0, 0, 0, 0.0),  # idle
        (0, 0.5, 3, 3, 0, 0.0),  # batch size unknown and no queue reported: a slot is free
        (0, 0.5, 3, 1, 2, 1.5),  # the engine queues 2: 3 completions until this one starts
        (4, 0.5, 3, 3, 0, 0.0),  # 3 of 4 slots busy
        (4, 0.5, 4, 4, 0, 0.5),  # all busy: the next completion frees one
        (4, 0.5, 6, 4, 0, 1.5),  # 2 routed since the engine's last report: queued behind
        (4, 0.5, 2, 4, 3, 2.0),  # engine reports more than the router routed (direct use)
    ],
)
def test_wait_is_the_queue_ahead_times_the_completion_interval(
    slots: int,
    interval: float | None,
    in_flight: int,
    running: int,
    waiting: int,
    expected: float,
) -> None:
    load = p.ReplicaLoad(running=running, waiting=waiting)
    assert tracker(slots, interval).wait_s(in_flight, load, now=0.0) == pytest.approx(expected)


def test_the_batch_size_is_learned_from_a_report_that_shows_a_queue() -> None:
    t = ServiceTracker()
    t.observed(p.ReplicaLoad(running=8, waiting=0))
    assert t.slots == 0  # 8 running and none waiting says nothing about the limit
    t.observed(p.ReplicaLoad(running=6, waiting=2))
    t.observed(p.ReplicaLoad(running=5, waiting=1))
    assert t.slots == 6


def test_the_interval_is_the_time_between_completions_while_busy() -> None:
    t = ServiceTracker()
    t.started(10.0)
    for done_at in (10.5, 11.0, 11.5):  # e.g. 8 requests of 4 s each: one every 0.5 s
        t.finished(done_at, still_busy=True)
    assert t.interval == pytest.approx(0.5)
    t.finished(12.0, still_busy=False)
    t.started(100.0)  # idle time between is not service time
    t.finished(100.5, still_busy=False)
    assert t.interval == pytest.approx(0.5)


def test_a_replica_completing_nothing_for_long_counts_as_that_slow() -> None:
    t = tracker(slots=1, interval=0.1)
    t.started(0.0)
    load = p.ReplicaLoad(running=1, waiting=1)
    assert t.wait_s(2, load, now=0.05) == pytest.approx(0.2)  # 2 x the mean
    assert t.wait_s(2, load, now=3.0) == pytest.approx(6.0)  # 2 x the open 3 s
    # The router still counts 2 in flight (a Release lost), but the engine reports nothing
    # running: not stalled, the usual interval counts.
    assert t.wait_s(2, p.ReplicaLoad(), now=3.0) == pytest.approx(0.2)


def test_within_budget_keeps_the_replicas_that_can_start_it_in_time() -> None:
    registry = Registry(lease_s=10)
    queued = p.ReplicaLoad(running=1, waiting=3)
    a = registry.register(p.Register("a", "m", "http://a", load=queued), now=0)
    b = registry.register(p.Register("b", "m", "http://b", load=p.ReplicaLoad()), now=0)
    a.service.interval = b.service.interval = 1.0
    candidates = registry.for_model("m")
    kept, shortest = within_budget(candidates, budget_s=2.0)
    assert kept == [b] and shortest == 0.0
    assert within_budget([a], budget_s=2.0) == ([], pytest.approx(4.0))
    assert within_budget(candidates, budget_s=10.0)[0] is candidates  # all of them: as is
    registry.set_routable("b", False)
    assert within_budget([b], budget_s=1.0) == ([b], 0.0)  # no routable one: not a budget matter


@pytest.fixture
def router() -> Iterator[RouterServer]:
    with running_router(loopback_router_config(lease_s=60.0)) as server:
        yield server


@pytest.fixture
def gateway(router: RouterServer) -> Iterator[zmq.Socket]:
    """One connection for the test's Routes: the router releases a connection's requests
    in flight when it closes (router/in_flight_book.py)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router.config.routing_bind)
    yield sock
    sock.close()


def ask(sock: zmq.Socket, msg: p.Route) -> p.RouteReply:
    sock.send(p.encode(msg))
    assert sock.poll(5000), "no answer from the router"
    reply = p.routing_reply_decoder.decode(sock.recv())
    assert isinstance(reply, p.RouteReply)
    return reply


def test_the_router_answers_over_budget_and_counts_nothing(
    router: RouterServer, gateway: zmq.Socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(queue_wait, "clock", lambda: 50.0)
    load = p.ReplicaLoad(running=2, waiting=4)
    replica = router.registry.register(p.Register("r1", "m", "http://r1", load=load), now=1e12)
    replica.service.interval = 0.5
    over = ask(gateway, p.Route(1, "m", queue_budget_s=1.0))
    assert over.error == OVER_QUEUE_BUDGET and not over.replica_id
    assert over.queue_wait_s == pytest.approx(2.5)  # (4 waiting + 1) x 0.5 s
    assert replica.in_flight == 0
    # Without a budget (a tenant that may not overflow) the request queues there.
    assert ask(gateway, p.Route(2, "m")).replica_id == "r1"
    assert ask(gateway, p.Route(3, "m", queue_budget_s=10.0)).replica_id == "r1"
    assert replica.in_flight == 2


def test_the_registry_times_completions_once_a_budget_was_asked_for() -> None:
    registry = Registry(lease_s=10)
    replica = registry.register(p.Register("a", "m", "http://a"), now=0)
    registry.routed(replica)
    registry.released("a")
    assert replica.service.interval is None  # nobody asked for a budget: not timed
    registry.track_service = True
    registry.routed(replica)
    registry.released("a")
    assert replica.service.interval is not None and replica.service.busy_since is None
