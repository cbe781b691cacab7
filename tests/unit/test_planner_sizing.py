"""Planner sizing: operating points, fleet and batch-job arithmetic, economics, calibration."""

import json

import pytest

from hpcserve.planner.calibrate import CalibratedModel, check_matches, load_calibration
from hpcserve.planner.capacity import (
    Limits,
    OperatingPoint,
    best_point,
    mixed_step,
    point_for_demand,
    requests_point,
)
from hpcserve.planner.economics import (
    Traffic,
    break_even_utilisation,
    economics,
    monthly_cost_usd,
    usd_per_million_tokens,
)
from hpcserve.planner.errors import PlanError
from hpcserve.planner.fleet import batch_job, size_fleet
from hpcserve.planner.gpus import GPUS
from hpcserve.planner.models import MODELS
from hpcserve.planner.perfmodel import StepBatch, StepTime
from hpcserve.planner.replica import Replica


class LinearModel:
    """A fake step model: 10 ms + 0.1 ms per decoding sequence + 0.01 ms per prompt token."""

    basis = "fake"

    def step_time(self, batch: StepBatch) -> StepTime:
        return StepTime(0.010 + 1e-4 * batch.decode_seqs + 1e-5 * batch.prefill_tokens)


# ---- operating points ----


def test_requests_point_by_hand():
    # B=100 in flight, P=1000, O=200: each step prefills 100/200 x 1000 = 500 prompt tokens.
    step = mixed_step(100, 1000, 200)
    assert (step.decode_seqs, step.prefill_tokens, step.decode_kv_tokens) == (100, 500, 110_000)
    point = requests_point(LinearModel(), 100, prompt=1000, output=200, token_budget=8192)
    tpot = 0.010 + 0.010 + 0.005
    assert point.tpot_s == pytest.approx(tpot)
    assert point.requests_per_s == pytest.approx(100 / (200 * tpot))  # 20 requests/s
    assert point.ttft_s == pytest.approx(0.010 + 99 * 1e-4 + 1000 * 1e-5)


def test_best_point_is_the_largest_batch_within_the_limits():
    def point(batch: int) -> OperatingPoint:
        tpot = 0.010 + 1e-4 * batch
        return OperatingPoint(batch, tpot, 0.1, batch / tpot, 0.0, "memory")

    # TPOT <= 20 ms: 10 + 0.1 B <= 20 -> B <= 100.
    assert best_point(point, Limits(256, tpot_s=0.020)) == (point(100), True)
    assert best_point(point, Limits(64, tpot_s=0.020)) == (point(64), True)
    assert best_point(point, Limits(256)) == (point(256), True)
    assert best_point(point, Limits(256, tpot_s=0.005)) == (point(1), False)
    assert best_point(point, Limits(256, ttft_s=0.05))[1] is False


def test_point_for_demand_is_where_a_replica_settles():
    def point(batch: int) -> OperatingPoint:
        tpot = 0.010 + 1e-4 * batch
        return OperatingPoint(batch, tpot, 0.1, batch / tpot, batch / (100 * tpot), "memory")

    # 100 output tokens per request: B / (100 x (10 ms + 0.1 B ms)) >= 5/s -> B >= 5.26 -> 6.
    settled = point_for_demand(point, 5.0, lambda p: p.requests_per_s, 256)
    assert settled.batch == 6
    assert point_for_demand(point, 1e9, lambda p: p.requests_per_s, 64).batch == 64


# ---- fleet ----


def test_size_fleet_by_hand():
    # 200 streams, 54 per replica at 85% load: ceil(200 / 45.9) = 5, plus one spare.
    fleet = size_fleet(200, 54, tp=1, gpus_per_node=8, spares=1, load=0.85)
    assert (fleet.replicas_needed, fleet.replicas, fleet.gpus, fleet.nodes) == (5, 6, 6, 1)
    fleet = size_fleet(40, 3.0, tp=4, gpus_per_node=8, spares=1, load=1.0)  # exact multiple
    assert (fleet.replicas_needed, fleet.gpus, fleet.replicas_per_node, fleet.nodes) == (
        14,
        60,
        2,
        8,
    )
    spanning = size_fleet(1, 10, tp=16, gpus_per_node=8, spares=2)
    assert (spanning.replicas, spanning.replicas_per_node, spanning.nodes) == (3, 0, 6)


def test_batch_job_gpu_hours_by_hand():
    # 1M documents at 3 documents/s per TP=4 replica: 1e6 / 3 / 3600 = 92.6 replica-hours.
    job = batch_job(1_000_000, 3000, 500, 3.0, tp=4, window_h=24, budget_gpus=8)
    assert job.replica_hours == pytest.approx(1e6 / 3 / 3600)
    assert job.gpu_hours == pytest.approx(4 * 1e6 / 3 / 3600)  # 370.4
    assert (job.replicas_for_window, job.gpus_for_window) == (4, 16)  # 92.6 / 24 -> 4
    assert job.hours_on_budget == pytest.approx(1e6 / 3 / 3600 / 2)  # 46.3 h on 2 replicas
    assert job.fits_window is False
    assert batch_job(1000, 10, 10, 1.0, tp=1, window_h=1, budget_gpus=1).fits_window is True
    with pytest.raises(PlanError, match="--gpus: 2 GPUs hold no replica of TP=4"):
        batch_job(10, 1, 1, 1.0, tp=4, budget_gpus=2)


# ---- economics ----


def test_cost_per_million_tokens_and_break_even_by_hand():
    # $2.50 x 4 GPUs = $10/h; 2,000 output tok/s = 7.2 M tokens/h at full use.
    assert usd_per_million_tokens(10.0, 2000, 1.0) == pytest.approx(10 / 7.2)
    assert usd_per_million_tokens(10.0, 2000, 0.5) == pytest.approx(2 * 10 / 7.2)
    assert monthly_cost_usd(4, 2.5) == 4 * 2.5 * 730
    assert break_even_utilisation(1.0, 4.0) == 0.25
    traffic = Traffic(2000, 20000, requests_per_s=5.0, prompt_tokens=4000, output_tokens=400)
    costs = economics(
        traffic,
        gpus_billed=4,
        gpu_hour_usd=2.5,
        utilisation=0.6,
        api_usd_per_m_input=3.0,
        api_usd_per_m_output=15.0,
    )
    assert costs.usd_per_m_output == pytest.approx(10 / 7.2 / 0.6)
    assert costs.usd_per_m_input == pytest.approx(10 / 72 / 0.6)
    assert costs.break_even_output == pytest.approx(10 / 7.2 / 15)
    assert costs.break_even_input == pytest.approx(10 / 72 / 3)
    # A request costs $10 / 3600 / 5 at full use; the API charges 4000 x $3 + 400 x $15 per M.
    own, api = 10 / 3600 / 5, (4000 * 3 + 400 * 15) / 1e6
    assert costs.break_even_workload == pytest.approx(own / api)
    assert (
        economics(traffic, gpus_billed=4, gpu_hour_usd=2.5, utilisation=1).break_even_output is None
    )


# ---- calibration ----

CALIBRATION = {
    "format": "hpcserve-calibration/1",
    "model": "llama-3.1-8b",
    "gpu": "h100",
    "tp": 1,
    "context": 8192,
    "prefill_tokens_per_s": 20000,
    "decode": [{"batch": 1, "tokens_per_s": 100}, {"batch": 32, "tokens_per_s": 1600}],
    "source": "test",
}


def _calibration(tmp_path, **change):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**CALIBRATION, **change}))
    return path


def test_calibrated_step_times_interpolate_and_hold_flat(tmp_path):
    model = CalibratedModel(load_calibration(_calibration(tmp_path)))
    assert model.decode_step_s(1) == pytest.approx(0.010)  # 1 / 100 tok/s
    assert model.decode_step_s(32) == pytest.approx(0.020)  # 32 / 1600
    assert model.decode_step_s(16) == pytest.approx(0.010 + 0.010 * 15 / 31)
    assert model.decode_step_s(64) == pytest.approx(0.040)  # 1,600 tok/s held flat
    step = model.step_time(StepBatch(decode_seqs=32, prefill_tokens=2000))
    assert step.total_s == pytest.approx(0.020 + 2000 / 20000) and step.bound == "measured"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decode": []}, "decode: expected array of length >= 1, got []"),
        ({"tp": 0}, "tp: expected int >= 1, got 0"),
        ({"format": "v2"}, "format: invalid enum value 'v2'"),
        (
            {"decode": [{"batch": 1, "tokens_per_s": -5}]},
            "decode[0].tokens_per_s: expected float > 0.0, got -5",
        ),
        ({"prefill_tokens_per_s": None}, "prefill_tokens_per_s: expected float, got null"),
        (
            {"decode": [{"batch": 8, "tokens_per_s": 1}, {"batch": 4, "tokens_per_s": 1}]},
            "decode[].batch must increase, got [8, 4]",
        ),
        ({"gpu": "h800"}, "gpu: unknown GPU 'h800'"),
        ({"bogus": 1}, "(top level): object contains unknown field bogus"),
    ],
)
def test_bad_calibration_files(tmp_path, change, message):
    with pytest.raises(PlanError) as err:
        load_calibration(_calibration(tmp_path, **change))
    assert str(err.value).startswith("--calibrate ") and message in str(err.value)


def test_calibration_must_match_the_replica(tmp_path):
    cal = load_calibration(_calibration(tmp_path))
    check_matches(cal, Replica(MODELS["llama-3.1-8b"], GPUS["h100"], 1))
    with pytest.raises(PlanError, match=r"tp: measured 1 but the plan uses 2 \(--tp\)"):
        check_matches(cal, Replica(MODELS["llama-3.1-8b"], GPUS["h100"], 2))
    with pytest.raises(PlanError, match="gpu: measured 'h100' but the plan uses 'H200"):
        check_matches(cal, Replica(MODELS["llama-3.1-8b"], GPUS["h200"], 1))
