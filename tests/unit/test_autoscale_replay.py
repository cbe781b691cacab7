"""bench/autoscale_replay.py's model: its bookkeeping on cases whose answer is known."""

from __future__ import annotations

import argparse

import numpy as np

from bench.autoscale_replay import hpcserve_policy, run_policy, static_policy
from hpcserve.config import AutoscaleConfig

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
