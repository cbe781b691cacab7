"""The batch at which a replica's TPOT reaches the SLO, measured from the engines' TPOT
histograms and running counts (poolmgr/batch_limit.py), and the autoscaler carrying it
(poolmgr/autoscale.py `Signals.carried`, autoscale_pools.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import parse_config
from hpcserve.contracts.protocol import LatencyHistogram, ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.autoscale import Signals
from hpcserve.poolmgr.autoscale_pools import AutoscaledPools
from hpcserve.poolmgr.batch_limit import STEADY_POLLS, BatchLimit, BatchLimits
from hpcserve.poolmgr.reconcile import ObservedJob

# vLLM's buckets for vllm:request_time_per_output_token_seconds.
BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
# Each request's TPOT over its batch's mean: +-15%, spread evenly (p95 1.135x the mean).
SPREAD = [0.85 + 0.3 * i / 19 for i in range(20)]


@dataclass
class Engine:
    """A replica's cumulative TPOT histogram, as its heartbeats carry it."""

    replica_id: str
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: int = 0
    sum: float = 0.0
    finished: int = 0

    def finish(self, mean_s: float, requests: int) -> None:
        for _ in range(requests):
            tpot = mean_s * SPREAD[self.finished % len(SPREAD)]
            self.finished += 1
            self.total += 1
            self.sum += tpot
            for j, bound in enumerate(BUCKETS):
                if tpot <= bound:
                    self.counts[j] += 1

    def info(self, running: int, pool: str = "chat") -> ReplicaInfo:
        hist = LatencyHistogram(list(BUCKETS), list(self.counts), self.total, self.sum)
        return ReplicaInfo(
            replica_id=self.replica_id, model="chat", url="http://n:1", pool=pool,
            slurm_job_id=int(self.replica_id[1:]), node="n", age_s=1, last_seen_age_s=0,
            in_flight=running, load=ReplicaLoad(running=running, tpot=hist),
        )  # fmt: skip


def linear(batch: float) -> float:
    """An engine whose mean TPOT is 20 ms + 1 ms per sequence in the batch: with p95 1.135x
    the mean, its TPOT p95 reaches 50 ms at batch 24.05."""
    return 0.020 + 0.001 * batch


def run(
    limits: BatchLimits,
    batches: list[int],
    *,
    per_poll: int = 20,
    polls_each: int = 6,
    tpot: object = linear,
    start: float = 0.0,
    poll_s: float = 5.0,
    speedup: float = 1.0,
) -> float:
    """Two replicas, each held at every batch in turn for `polls_each` polls, finishing
    `per_poll` requests a poll at that batch's TPOT; the time of the last poll."""
    engines = [Engine("r1"), Engine("r2")]
    now = start
    limits.observe("chat", [e.info(batches[0]) for e in engines], now, speedup)
    counts = [batches[0]]
    for batch in batches:
        for _ in range(polls_each):
            now += poll_s
            counts = [*counts, batch][-STEADY_POLLS:]
            lived = sum(counts) / len(counts)  # the batch over the finished requests' lives
            for e in engines:
                e.finish(tpot(lived), per_poll)  # type: ignore[operator]
            limits.observe("chat", [e.info(batch) for e in engines], now, speedup)
    return now


def test_a_linear_engine_gives_the_batch_at_the_slo() -> None:
    limits = BatchLimits()
    run(limits, [4, 8, 12, 16, 20, 24, 28, 32])
    limit = limits.measured("chat", 0.050)
    assert limit is not None
    assert limit.reached
    # The spread's top twentieth over 50 ms from batch 24.05 on: the crossing between the
    # two bins either side of it.
    assert limit.low <= 24.05 <= limit.high
    assert limit.over[0] <= 0.05 < limit.over[1]
    assert limit.batch == pytest.approx(24.05, rel=0.02)
    assert limit.capacity(64) == 23  # measured, below the model's 64
    assert limit.capacity(8) == 23  # and above a guess of 8
    assert limit.describe().startswith("TPOT p95 reaches 50 ms at batch 23.")


def test_an_slo_between_bucket_bounds_errs_low() -> None:
    """An SLO of 60 ms, between vLLM's 50 and 75 ms bounds: the share over it is read within
    its bucket as if its requests spread evenly (as histogram_quantile takes them), which
    counts those just over 50 ms too soon: the batch comes out between where the p95
    reaches the bound below (24.05) and the truth (32.9), never above the truth."""
    limits = BatchLimits()
    run(limits, [10, 15, 20, 25, 30, 35, 40, 45])
    limit = limits.measured("chat", 0.060)
    assert limit is not None and limit.reached
    truth = (0.060 / 1.134 - 0.020) / 0.001
    assert 23.5 <= limit.batch <= truth


@pytest.mark.parametrize(
    ("prior", "expected"),
    [
        (4, 12),  # a guess below: up towards the line's guess, to twice the largest seen
        (16, 16),  # between twice the largest seen and the guess: holds
        (48, 24),  # above the guess (24.0): down to it
    ],
)
def test_past_the_batches_seen_the_range_bounds_the_prior(prior: int, expected: int) -> None:
    limits = BatchLimits()
    run(limits, [2, 3, 4, 5, 6], polls_each=8)
    limit = limits.measured("chat", 0.050)
    assert limit is not None
    assert not limit.reached
    assert limit.batch == pytest.approx(24.05, rel=0.1)  # the line's guess
    assert (limit.low, limit.high) == (12, limit.batch)
    assert limit.capacity(prior) == expected
    assert "up to batch 6, the largest seen; its mean's line reaches 50 ms at" in (limit.describe())


@pytest.mark.parametrize(
    ("batches", "tpot", "per_poll", "why"),
    [
        ([4, 8, 12, 16, 20, 24, 28], linear, 2, "too few requests"),
        ([10, 10, 10, 10], linear, 20, "one batch: no spread"),
        ([10, 11, 12, 13], linear, 20, "a spread under 1.5x"),
        ([4, 8, 12, 16], lambda b: 0.030, 20, "within the SLO, TPOT flat in the batch"),
        ([4, 8, 12, 16], lambda b: 0.080 + 0.001 * b, 20, "over the SLO at every batch"),
    ],
)
def test_no_figure_where_the_window_cannot_say(
    batches: list[int], tpot: object, per_poll: int, why: str
) -> None:
    limits = BatchLimits()
    run(limits, batches, tpot=tpot, per_poll=per_poll)
    assert limits.measured("chat", 0.050) is None, why


def test_requests_finishing_as_the_batch_moves_are_left_out() -> None:
    """A burst's end: the requests finishing while a replica drains ran at the burst's
    batch; put at the falling counts they would read as slow small batches."""
    limits = BatchLimits(min_requests=1, min_bin_requests=1)
    engine = Engine("r1")
    for i, running in enumerate([40, 40, 40, 40, 20, 10, 5, 2]):
        engine.finish(linear(40), 20)
        limits.observe("chat", [engine.info(running)], 5.0 * i)
    kept = limits._finished["chat"]
    assert [f.batch for f in kept] == [40, 40, 40]  # the steady polls only


def test_a_restarted_engine_and_a_gap_count_nothing_unseen() -> None:
    limits = BatchLimits(min_requests=1, min_bin_requests=1)
    old, new = Engine("r1"), Engine("r1")
    old.finish(0.03, 50)
    limits.observe("chat", [old.info(8)], 0.0)
    new.finish(0.03, 5)  # restarted: its counts went back to 5
    limits.observe("chat", [new.info(8)], 5.0)
    assert not limits._finished["chat"]  # the interval was skipped, not negative
    limits.gap()
    new.finish(0.03, 5)
    limits.observe("chat", [new.info(8)], 10.0)  # after a gap: the base again
    assert not limits._finished["chat"]
    new.finish(0.03, 5)
    limits.observe("chat", [new.info(8)], 15.0)
    assert [f.tpot.total for f in limits._finished["chat"]] == [5]
    limits.forget("chat")
    assert limits.measured("chat", 0.05) is None


def test_the_window_is_an_hour_of_real_time() -> None:
    """Requests older than an hour go; in a rehearsal at 60x, 60 hours of its clock."""
    limits = BatchLimits()
    end = run(limits, [4, 8, 12, 16, 20, 24, 28, 32])
    assert limits.measured("chat", 0.05) is not None
    limits.observe("chat", [Engine("r1").info(0)], end + 3600.0)  # nothing new since
    assert limits.measured("chat", 0.05) is None
    rehearsal = BatchLimits()
    run(rehearsal, [4, 8, 12, 16, 20, 24, 28, 32], poll_s=300.0, speedup=60.0)
    assert rehearsal.measured("chat", 0.05) is not None  # 4 hours of its clock, 4 real min


LIMIT = BatchLimit(24.0, 28.0, 24.5, True, 700, 4.0, 32.0, 0.05)
PAST = BatchLimit(12.0, 23.8, 23.8, False, 700, 2.0, 6.0, 0.05)


@pytest.mark.parametrize(
    ("limit", "capacity", "capacity_rps", "carried", "is_limit"),
    [
        (None, 40, 4.0, 40, True),  # the model's, a limit
        (None, None, None, 8, False),  # the config's target: no margin
        (LIMIT, 40, 4.0, 24, True),  # measured within the data: replaces the model
        (LIMIT, None, None, 24, True),  # and the target
        (PAST, 40, 4.0, 23, True),  # past the data: a model above comes down to the guess
        (PAST, 16, 2.0, 16, True),  # one between twice the largest seen and the guess holds
        (PAST, None, None, 12, True),  # the target below goes up, to twice the largest seen
    ],
)
def test_the_autoscaler_carries_the_measured_batch(
    limit: BatchLimit | None,
    capacity: int | None,
    capacity_rps: float | None,
    carried: int,
    is_limit: bool,
) -> None:
    sig = Signals(replicas=[], capacity=capacity, capacity_rps=capacity_rps, batch_limit=limit)
    assert sig.carried(8) == (carried, is_limit)
    assert sig.per_replica(8) == carried


def test_a_target_the_guess_does_not_contradict_holds_without_a_margin() -> None:
    sig = Signals(replicas=[], batch_limit=PAST)
    assert sig.carried(16) == (16, False)


CONFIG = parse_config(
    {
        "pools": [
            {"name": "chat", "model_path": "/m", "replicas": 1,
             "autoscale": {"max": 40, "target_in_flight": 8, "tpot_p95_s": 0.05}},
        ]
    }
)  # fmt: skip


def test_the_pool_manager_measures_the_batch_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two replicas through batches 4..32 on the linear engine: the pool manager's sizing
    carries the measured batch in place of the config's 8, exports it, logs it once, and
    `hpcserve status` says where it comes from."""
    caplog.set_level(logging.INFO, "hpcserve.poolmgr.autoscale_pools")
    registry = CollectorRegistry()
    pools = AutoscaledPools(registry)
    jobs = [ObservedJob(job_id=j, pool="chat", pending=False, submit_time=1, serving=True)
            for j in (1, 2)]  # fmt: skip
    engines = [Engine("r1"), Engine("r2")]
    now = 1000.0
    counts: list[int] = []
    for batch in (4, 8, 12, 16, 20, 24, 28, 32):
        for _ in range(6):
            counts = [*counts, batch][-STEADY_POLLS:]
            for e in engines:
                e.finish(linear(sum(counts) / len(counts)), 20)
            pools.resize(CONFIG, {"chat": 2}, {}, jobs, {}, [e.info(batch) for e in engines],
                         {}, now)  # fmt: skip
            now += 5.0
    sig = pools.signals["chat"]
    assert sig.batch_limit is not None
    carried = sig.carried(8)[0]
    assert carried == 23  # the crossing at 23.x (24.05 in truth)
    assert sig.per_replica(8) == carried
    assert (
        registry.get_sample_value(
            "hpcserve_poolmgr_autoscale_capacity_in_flight", {"pool": "chat", "source": "measured"}
        )
        == carried
    )
    assert (
        registry.get_sample_value(
            "hpcserve_poolmgr_autoscale_capacity_in_flight", {"pool": "chat", "source": "modelled"}
        )
        == 8
    )
    text = sig.capacity_text(8)
    assert text.startswith("one replica sustains 23 in flight (measured: TPOT p95 reaches 50")
    assert "before: 8, config target_in_flight, not modelled)" in text
    lines = [r.getMessage() for r in caplog.records if "measured:" in r.getMessage()]
    assert lines and all(line.startswith("pool chat: one replica carries") for line in lines)
    assert len(lines) <= 5  # on a change of a quarter or more, not each poll
