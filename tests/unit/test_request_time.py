"""A request's time in a replica measured by Little's law (poolmgr/request_time.py), and the
autoscaler sizing a forecast with it (poolmgr/autoscale.py, autoscale_pools.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import parse_config
from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.autoscale import Signals
from hpcserve.poolmgr.autoscale_pools import AutoscaledPools
from hpcserve.poolmgr.reconcile import ObservedJob
from hpcserve.poolmgr.request_time import MeasuredTime, RequestTimes


def steady(times: RequestTimes, *, rate: float, seconds: float, poll_s: float, polls: int,
           start: float = 0.0, weight: float = 1.0) -> None:  # fmt: skip
    """`polls` polls of a pool in a steady state: `rate` requests/s (real) that each run
    `seconds`, so rate x seconds are running; under a rehearsal's clock (`weight` = k) the
    polls come k times as far apart on it."""
    for i in range(polls):
        times.observe("p", start + i * poll_s * weight, round(rate * seconds),
                      round(rate * poll_s) if i else 0, weight)  # fmt: skip


@pytest.mark.parametrize(
    ("rate", "seconds", "poll_s", "polls", "weight", "expected", "requests"),
    [
        (2.0, 6.0, 5.0, 30, 1.0, 6.0, 290),  # 12 running, 10 requests a poll
        (0.5, 30.0, 10.0, 40, 1.0, 30.0, 195),  # long requests, few of them
        (10.0, 0.2, 1.0, 20, 1.0, 0.2, 190),  # short ones (an embedding pool)
        # A rehearsal's clock (60x): still real seconds; its hour is 60 real s, 12 polls.
        (2.0, 6.0, 5.0, 30, 60.0, 6.0, 120),
        (2.0, 6.0, 5.0, 3, 1.0, None, 0),  # 20 requests: too few to say
        (0.0, 6.0, 5.0, 30, 1.0, None, 0),  # nothing ran
    ],
)
def test_steady_state_gives_the_requests_time(
    rate: float,
    seconds: float,
    poll_s: float,
    polls: int,
    weight: float,
    expected: float | None,
    requests: int,
) -> None:
    times = RequestTimes()
    steady(times, rate=rate, seconds=seconds, poll_s=poll_s, polls=polls, weight=weight)
    measured = times.measured("p")
    if expected is None:
        assert measured is None
    else:
        assert measured is not None
        assert measured.seconds == pytest.approx(expected)
        assert measured.requests == requests


def simulate(times: RequestTimes, rate: Callable[[float], float], seconds: float,
             until: float, poll_s: float = 5.0, weight: float = 1.0) -> None:  # fmt: skip
    """Requests arriving at `rate(t)` per second that each run `seconds`, no queue; polled
    every `poll_s` (on a clock `weight` times faster) for the running and routed counts."""
    step, due = 0.01, 0.0
    ends: list[float] = []
    routed = last_routed = 0
    t = 0.0
    next_poll = 0.0
    while t < until:
        due += rate(t) * step
        while due >= 1:
            due -= 1
            routed += 1
            ends.append(t + seconds)
        if t >= next_poll:
            running = sum(1 for e in ends if e > t)
            times.observe("p", t * weight, running, routed - last_routed, weight)
            last_routed = routed
            next_poll += poll_s
        t += step


@pytest.mark.parametrize(
    ("shape", "weight"),
    [
        ("rising", 1.0),  # 0.2 -> 2 req/s over the window: more cut at its end
        ("falling", 1.0),  # 2 -> 0.2: more cut at its start
        ("rising", 60.0),  # the same on a rehearsal's clock
    ],
)
def test_the_windows_edges_cancel_while_the_load_rises_or_falls(shape: str, weight: float) -> None:
    """6 s requests over a 60 s window (a rehearsal's hour at 60x) while the rate changes
    ten-fold: running / routed alone reads 5.49 s on the rise (8.5% short); less half the
    growth of the requests in the engines, 6.09 (within 5%; falling 5.90 and 6.04)."""
    times = RequestTimes(window_s=60.0 * weight, min_requests=20)

    def rate(t: float) -> float:
        x = min(t / 60.0, 1.0)
        return 0.2 + 1.8 * (x if shape == "rising" else 1 - x)

    simulate(times, rate, 6.0, until=60.0, weight=weight)
    measured = times.measured("p")
    assert measured is not None
    assert measured.seconds == pytest.approx(6.0, rel=0.05)


def test_the_window_keeps_the_last_hour_and_a_gap_integrates_nothing() -> None:
    times = RequestTimes(window_s=600.0, min_requests=10)
    steady(times, rate=2.0, seconds=6.0, poll_s=5.0, polls=200)  # 1,000 s at 6 s
    steady(times, rate=2.0, seconds=3.0, poll_s=5.0, polls=200, start=1000.0)
    # The first poll of the second run joins the two (12 -> 6 running over 5 s, 0 routed).
    measured = times.measured("p")
    assert measured is not None and measured.seconds == pytest.approx(3.0)
    assert measured.window_s == pytest.approx(600.0, abs=5.0)
    times.gap()  # the router did not answer: the next poll starts afresh
    times.observe("p", 2100.0, 100, 40)
    assert times.measured("p") == measured  # nothing integrated over the gap ...
    times.forget("p")
    assert times.measured("p") is None  # ... and a pool that stopped autoscaling is gone


def test_a_clock_that_stands_still_or_goes_back_adds_nothing() -> None:
    times = RequestTimes(min_requests=1)
    times.observe("p", 100.0, 4, 0)
    times.observe("p", 100.0, 4, 3)
    times.observe("p", 90.0, 4, 3)
    assert times.measured("p") is None


CONFIG = parse_config(
    {
        "pools": [
            {"name": "chat", "model_path": "/m", "replicas": 1,
             "autoscale": {"max": 40, "target_in_flight": 4}},
        ]
    }
)  # fmt: skip


def signals(**kw: object) -> Signals:
    return Signals(replicas=[], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("measured", "capacity", "capacity_rps", "expected"),
    [
        (None, 4, 4 / 6.0, 6.0),  # the model's: its in flight over its requests/s
        (MeasuredTime(12.0, 400, 3600.0), 4, 4 / 6.0, 12.0),  # measured wins over it
        (MeasuredTime(3.0, 400, 3600.0), None, None, 3.0),  # and over no model
        (None, None, None, None),  # nothing known (no load, no rate)
    ],
)
def test_the_forecast_sizes_with_the_measured_time_first(
    measured: MeasuredTime | None,
    capacity: int | None,
    capacity_rps: float | None,
    expected: float | None,
) -> None:
    sig = signals(request_time=measured, capacity=capacity, capacity_rps=capacity_rps,
                  forecast_rps=2.0)  # fmt: skip
    assert sig.request_s() == expected
    auto = CONFIG.pools[0].autoscale
    assert auto is not None
    if expected is not None:
        margin = auto.queueing_margin if capacity else 0.0
        in_flight = 2.0 * expected
        slots = in_flight + margin * math.sqrt(in_flight)
        assert sig.forecast_need(auto, 4) == math.ceil(slots / 4 - 1e-9)


def replica(routed: int, running: int, job_id: int = 1) -> ReplicaInfo:
    return ReplicaInfo(
        replica_id=f"r{job_id}", model="chat", url="http://n:1", pool="chat",
        slurm_job_id=job_id, node="n", age_s=1, last_seen_age_s=0, in_flight=running,
        load=ReplicaLoad(running=running), routed=routed,
    )  # fmt: skip


def test_the_pool_manager_measures_its_pools_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """Requests that run 12 s where the config's capacity says nothing of their time: the
    pool manager measures 12 s from the router's lists, sizes the forecast with it, exports
    it and `hpcserve status` says it; a draining replica's running requests still count."""
    caplog.set_level(logging.INFO, "hpcserve.poolmgr.autoscale_pools")
    registry = CollectorRegistry()
    pools = AutoscaledPools(registry)
    jobs = [ObservedJob(job_id=j, pool="chat", pending=False, submit_time=1, serving=True)
            for j in (1, 2)]  # fmt: skip
    routed = 0
    # 1 req/s for 400 s, 12 running: 6 on each of two replicas (the first poll's counts are
    # from before; the second is where the integral starts).
    for i in range(80):
        routed += 5 if i else 0
        listed = [replica(routed, 6), msgspec.structs.replace(replica(0, 6, 2), routed=0)]
        # Job 2 drains: out of the pool's serving replicas, its 6 running still counted.
        pools.resize(CONFIG, {"chat": 2}, {}, jobs, {2: 0.0}, listed, {}, 1000.0 + 5 * i)
    sig = pools.signals["chat"]
    assert sig.request_time is not None
    assert sig.request_time.seconds == pytest.approx(12.0)
    assert sig.request_time.requests == 390
    assert sig.request_s() == pytest.approx(12.0)
    assert registry.get_sample_value(
        "hpcserve_poolmgr_autoscale_request_seconds", {"pool": "chat", "source": "measured"}
    ) == pytest.approx(12.0)
    text = sig.capacity_text(4, 2)
    assert "a request runs 12 s measured over 390 requests" in text
    timed = [r.getMessage() for r in caplog.records if "measured time" in r.getMessage()]
    assert timed == ["pool chat: sizing with a request's measured time in a replica, "
                     "12 s measured over 100 requests"]  # fmt: skip
