"""What one replica of an autoscaled pool sustains (poolmgr/autoscale_capacity.py): from the
planner's roofline or a calibration at the pool's SLO, else the config's target_in_flight;
the engines' queueing figures win when lower; decide() and the forecast use it; the status
says where the number comes from."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from hpcserve.config import (
    AutoscaleCapacity,
    AutoscaleConfig,
    ConfigError,
    PoolConfig,
    parse_config,
)
from hpcserve.planner import Factors, PlanRequest
from hpcserve.planner.plan import resolve
from hpcserve.poolmgr.autoscale import AutoscaleState, ReplicaSignal, Signals, decide
from hpcserve.poolmgr.autoscale_capacity import Capacities, check, modelled

SLO = {"ttft_p95_s": 0.8, "tpot_p95_s": 0.05}


def pool(capacity: dict[str, object] | None, *, tp: int = 1, **auto: object) -> PoolConfig:
    cfg = {"max": 8, "target_in_flight": 4, **SLO, **auto}
    if capacity is not None:
        cfg["capacity"] = capacity
    return parse_config(
        {
            "pools": [
                {
                    "name": "chat",
                    "model_path": "/m",
                    "tensor_parallel": tp,
                    "gpus_per_replica": tp,
                    "autoscale": cfg,
                }
            ]
        }
    ).pools[0]


def calibration(tmp_path: Path) -> str:
    """Measured: 10 ms a step at batch 1, 20 ms at 32, 30 ms at 64; prefill nearly free."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({
        "format": "hpcserve-calibration/1", "model": "llama-3.1-8b", "gpu": "h100", "tp": 1,
        "prefill_tokens_per_s": 1e9, "source": "test",
        "decode": [{"batch": 1, "tokens_per_s": 100}, {"batch": 32, "tokens_per_s": 1600},
                   {"batch": 64, "tokens_per_s": 64 / 0.030}],
    }))  # fmt: skip
    return str(path)


EIGHT_B = {"model": "llama-3.1-8b", "gpu": "h100", "prompt_tokens": 1000, "output_tokens": 200}


@pytest.mark.parametrize(
    ("capacity", "auto", "in_flight", "source"),
    [
        # A latency SLO that binds: the largest batch within TPOT 20 ms (the planner's table).
        (EIGHT_B, {"tpot_p95_s": 0.02}, 108, "roofline: llama-3.1-8b on H100 SXM 80GB TP 1"),
        # A loose SLO: the engine's max_num_seqs bounds it.
        (EIGHT_B, {}, 256, "bound by max_num_seqs (256)"),
        ({**EIGHT_B, "max_num_seqs": 64}, {}, 64, "bound by max_num_seqs (64)"),
        # 70B needs TP 4 (the pool's tensor_parallel) and carries fewer.
        (
            {**EIGHT_B, "model": "llama-3.1-70b"},
            {"tp": 4},
            95,
            "llama-3.1-70b on H100 SXM 80GB TP 4",
        ),
        # An SLO no batch meets: one request at a time, and said so.
        (EIGHT_B, {"ttft_p95_s": 0.001}, 1, "misses TTFT 0.001 s / TPOT 0.05 s even at batch 1"),
        # No capacity section: the config's guess, labelled as one.
        (None, {}, 4, "config target_in_flight, not modelled"),
    ],
)
def test_one_replica_sustains_what_the_planner_gives_at_the_slo(
    capacity: dict[str, object] | None, auto: dict[str, object], in_flight: int, source: str
) -> None:
    tp = int(auto.pop("tp", 1))  # type: ignore[call-overload]
    got = Capacities().of(pool(capacity, tp=tp, **auto))
    assert got.in_flight == in_flight and source in got.source
    assert (got.requests_per_s is None) == (capacity is None)


def test_the_modelled_batch_is_the_largest_within_the_slo() -> None:
    """At the capacity the planner's TPOT is within the SLO; one more request breaks it."""
    p = pool(EIGHT_B, tpot_p95_s=0.02)
    got = modelled(p)
    setup = resolve(
        PlanRequest(model="llama-3.1-8b", gpu="h100", context=1200, tp=1, requests_per_s=1.0,
                    prompt_tokens=1000, output_tokens=200),
        Factors(),
    )  # fmt: skip
    at = setup.point_at()
    assert at(got.in_flight).tpot_s <= 0.02 < at(got.in_flight + 1).tpot_s
    assert got.requests_per_s == pytest.approx(at(got.in_flight).requests_per_s)


def test_a_calibration_file_replaces_the_roofline(tmp_path: Path) -> None:
    # TPOT 25.1 ms: the measured step is 20 ms at 32 and 30 ms at 64, so the batch is 48
    # (25 ms, and a negligible prefill share).
    got = modelled(pool({**EIGHT_B, "calibrate": calibration(tmp_path)}, tpot_p95_s=0.0251))
    assert got.in_flight == 48 and got.source.startswith(f"calibration {tmp_path}")
    assert got.requests_per_s == pytest.approx(48 / (200 * 0.025), rel=0.001)


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        ({**EIGHT_B, "model": "llama-3.1-70b", "gpu": "a100"}, "pools[0].autoscale.capacity: --tp"),
        ({**EIGHT_B, "gpu": "tpu9"}, "pools[0].autoscale.capacity: "),
        ({**EIGHT_B, "model": "no-such-model"}, "neither a catalog model"),
        ({**EIGHT_B, "calibrate": "/nonexistent.json"}, "cannot read /nonexistent.json"),
    ],
)
def test_the_pool_manager_refuses_a_capacity_the_planner_cannot_answer(
    capacity: dict[str, object], message: str
) -> None:
    config = parse_config(
        {"pools": [{"name": "chat", "model_path": "/m",
                    "autoscale": {"max": 4, "capacity": capacity}}]}
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^pools\[0\]\.autoscale\.capacity: ") as err:
        check(config)
    assert message in str(err.value)


def test_a_reload_the_planner_refuses_falls_back_to_target_in_flight_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = pool({**EIGHT_B, "model": "no-such-model"})
    caplog.set_level(logging.INFO, "hpcserve.poolmgr.autoscale_capacity")
    capacities = Capacities()
    assert capacities.of(bad).in_flight == 4
    assert capacities.of(bad).in_flight == 4  # worked out once per config of the pool
    assert [r.levelname for r in caplog.records] == ["ERROR", "INFO"]


CFG = AutoscaleConfig(max=8, target_in_flight=4, scale_up_window_s=0, warm_spares=0)


@pytest.mark.parametrize(
    ("capacity", "running", "waiting", "load", "target"),
    [
        (None, 0, 0, 25, 7),  # 25 at target_in_flight 4: 7
        (10, 0, 0, 25, 3),  # 25 at the modelled 10: 3
        (10, 5, 3, 25, 5),  # the engines queue at 5 running: 5 holds, 25 needs 5
        # one or two waiting (max_waiting_per_replica, 2): a request between two engine
        # steps or behind a prefill, not a queue; the model holds (before: 1 -> 25, max 8)
        (10, 1, 1, 25, 3),
        (10, 1, 2, 25, 3),
        (3, 5, 3, 25, 8),  # the model says 3, lower than what the engines run: 9, max 8
    ],
)
def test_decide_sizes_by_the_modelled_capacity_unless_the_engines_queue_lower(
    capacity: int | None, running: int, waiting: int, load: int, target: int
) -> None:
    replica = ReplicaSignal(in_flight=load, running=running, waiting=waiting, kv_usage=0.1)
    sig = Signals(replicas=[replica], capacity=capacity)
    decision = decide(CFG, sig, AutoscaleState(target=1), 100.0)
    assert decision.target == target


@pytest.mark.parametrize(
    ("capacity", "rps", "forecast", "spares", "need"),
    [
        (10, 5.0, 21.0, 0, 5),  # 21 req/s at 5 req/s a replica: 5
        (10, 5.0, 21.0, 1, 6),  # and a warm spare
        (10, 5.0, 0.0, 0, 0),  # nothing forecast
        (None, None, 21.0, 0, 11),  # Little's law: 21 req/s x 10 in flight / 5 req/s = 42, at 4
    ],
)
def test_the_forecast_becomes_replicas_by_the_modelled_rate(
    capacity: int | None, rps: float | None, forecast: float, spares: int, need: int
) -> None:
    # No queueing margin: the rate's requests in flight alone (the margin: test_autoscale.py).
    cfg = AutoscaleConfig(max=8, target_in_flight=4, warm_spares=spares, queueing_margin=0)
    sig = Signals(
        replicas=[ReplicaSignal(10, 10, 0, 0.1)], capacity=capacity, capacity_rps=rps,
        rate_rps=5.0, forecast_rps=forecast,
    )  # fmt: skip
    assert sig.forecast_need(cfg, sig.per_replica(cfg.target_in_flight)) == need


def test_status_says_what_one_replica_sustains_and_where_it_comes_from() -> None:
    cap = modelled(pool(EIGHT_B, tpot_p95_s=0.02))
    sig = Signals(replicas=[], capacity=cap.in_flight, capacity_rps=cap.requests_per_s,
                  capacity_source=cap.source)  # fmt: skip
    text = sig.capacity_text(4)
    assert text.startswith("one replica sustains 108 in flight, 27.1 req/s (roofline: ")
    queueing = Signals(replicas=[ReplicaSignal(9, 6, 3, 0.5)], capacity=108)
    assert queueing.capacity_text(4).endswith("its engines queue at 6 running, so 6 holds now")
    assert "config target_in_flight" in Signals(replicas=[]).capacity_text(4)


def test_capacity_section_is_typed_config() -> None:
    with pytest.raises(ConfigError, match=re.escape("pools[0].autoscale.capacity.prompt_tokens")):
        parse_config({"pools": [{"name": "c", "model_path": "/m", "autoscale": {
            "max": 2, "capacity": {**EIGHT_B, "prompt_tokens": 0}}}]})  # fmt: skip
    assert AutoscaleConfig(max=2).capacity is None
    assert AutoscaleCapacity(**EIGHT_B).tp == 0  # type: ignore[arg-type]
