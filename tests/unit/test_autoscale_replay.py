"""bench/autoscale_replay.py's model: its bookkeeping on cases whose answer is known."""

from __future__ import annotations

import argparse

import numpy as np

from bench.autoscale_replay import (
    full_policy,
    hpcserve_policy,
    learned_forecasts,
    run_policy,
    static_policy,
)
from hpcserve.config import AutoscaleConfig
from hpcserve.poolmgr.cold_start import ColdStartSample
from hpcserve.poolmgr.forecast import Forecasts

ARGS = argparse.Namespace(dt=0.5, slots=4, service_s=2.0, prefill_s=0.1, poll_s=5.0)


def test_static_capacity_above_the_load_serves_everything_at_once() -> None:
    arrivals = np.ones(7200, dtype=np.int64)  # 2 requests/s for an hour; 2 replicas hold 4/s
    result = run_policy(static_policy(2), arrivals, lambda: (0.0, 0.0), ARGS, 2)
    assert result["requests"] == 7200 and result["slo_attainment"] == 1.0
    assert result["gpu_hours"] == 2.0 and result["changes"] == 0
    assert abs(result["utilisation"] - 0.5) < 0.01  # 4 of 8 slots busy


def test_too_little_capacity_queues_and_misses_the_slo() -> None:
    arrivals = np.full(7200, 2, dtype=np.int64)  # 4 requests/s on one replica that holds 2/s
    result = run_policy(static_policy(1), arrivals, lambda: (0.0, 0.0), ARGS, 1)
    assert result["slo_attainment"] < 0.01 and result["ttft_p95_s"] is None


def test_the_autoscaler_grows_after_the_cold_start_and_shrinks_when_the_load_goes() -> None:
    # An hour at 4 requests/s (2 replicas' worth), then an idle hour; cold start 60 s + 120 s.
    arrivals = np.concatenate([np.full(7200, 2, dtype=np.int64), np.zeros(7200, dtype=np.int64)])
    cfg = AutoscaleConfig(max=4, target_in_flight=4)
    result = run_policy(hpcserve_policy(cfg, 1), arrivals, lambda: (60.0, 120.0), ARGS, 1)
    # The first minutes queue (one replica, more coming up), then everything is served.
    assert 0.9 < result["slo_attainment"] < 1.0
    assert result["changes"] >= 2  # up, then down
    assert result["gpu_hours"] < 4 * 2  # less than max for the two hours


def test_the_forecast_has_replicas_serving_when_a_known_step_comes() -> None:
    """An hour at 0.5 req/s then 6 req/s (3 replicas' worth), yesterday and today; cold
    start 180 s, as measured before. The profile learnt yesterday raises the pool ahead of
    01:00; the queue rules alone only see the step when it queues."""
    step = np.concatenate([np.full(3600, 0.25), np.full(3600, 3.0)])  # per 0.5 s
    yesterday = np.random.default_rng(1).poisson(step)
    today = np.random.default_rng(2).poisson(step)
    cfg = AutoscaleConfig(max=6, target_in_flight=4)
    history = [ColdStartSample(0, 60.0, 120.0, 0.0)] * 5
    ahead = full_policy(cfg, 1, learned_forecasts(yesterday, 0.5, 5.0), history, (4, 1.8))
    forecast = run_policy(ahead, today, lambda: (60.0, 120.0), ARGS, 1)
    reactive = run_policy(hpcserve_policy(cfg, 1), today, lambda: (60.0, 120.0), ARGS, 1)
    assert forecast["slo_attainment"] > 0.99 > reactive["slo_attainment"]
    assert forecast["gpu_hours"] < 6 * 2  # not sized for max


def test_scale_to_zero_sleeps_through_the_idle_hours_and_wakes_on_a_request() -> None:
    """A request every 10 s for an hour, two idle hours, then an hour again: min 0 releases
    the GPUs after idle_s and the first request of the next hour wakes the pool (it waits
    the cold start); min 1 holds a replica all along."""
    busy = np.zeros(7200, dtype=np.int64)
    busy[::20] = 1
    arrivals = np.concatenate([busy, np.zeros(14400, dtype=np.int64), busy])
    history = [ColdStartSample(0, 30.0, 30.0, 0.0)]

    def run(minimum: int) -> dict[str, object]:
        cfg = AutoscaleConfig(min=minimum, max=2, target_in_flight=4, idle_s=600)
        policy = full_policy(cfg, 1, Forecasts(None), history, (4, 1.8))
        return run_policy(policy, arrivals, lambda: (30.0, 30.0), ARGS, 1)

    asleep, awake = run(0), run(1)
    assert awake["gpu_hours"] == 4.0 and awake["slo_attainment"] == 1.0
    # Asleep from 10 min after the first hour until the wake: about 1 h 50 min less.
    assert 2.0 < asleep["gpu_hours"] < 2.3
    assert asleep["changes"] == 2  # to zero, woken
    assert asleep["requests"] == awake["requests"] == 720
    # Only the requests that came during the wake's cold start (60 s) miss the SLO.
    assert 0.98 < asleep["slo_attainment"] < 1.0
