"""plan(): the report end to end, the CLI (table, --json, exit codes) and bad input."""

import argparse
import json
import math

import msgspec
import pytest

from hpcserve.planner import PlanError, PlanRequest, plan
from hpcserve.planner.cli import add_plan_parser
from hpcserve.planner.factors import Factors

CHAT = {"model": "llama-3.1-8b", "gpu": "h100"}
EXTRACTION = {
    "model": "llama-3.1-70b",
    "gpu": "h100",
    "batch_docs": 1_000_000,
    "batch_input_tokens": 3000,
    "batch_output_tokens": 500,
    "batch_window_h": 24,
    "gpus": 16,
}
CALIBRATION = {
    "format": "hpcserve-calibration/1",
    "model": "llama-3.1-8b",
    "gpu": "h100",
    "tp": 1,
    "prefill_tokens_per_s": 20000,
    "decode": [{"batch": 1, "tokens_per_s": 100}, {"batch": 32, "tokens_per_s": 1600}],
}


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="hpcserve")
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_shape(capsys):
    code, out, err = run_cli(
        [
            "--model",
            "llama-3.1-8b",
            "--gpu",
            "h100",
            "--requests-per-s",
            "20",
            "--prompt-tokens",
            "1000",
            "--output-tokens",
            "300",
            "--tpot-slo-ms",
            "40",
            "--gpus",
            "8",
            "--batch-docs",
            "1000",
            "--batch-input-tokens",
            "500",
            "--batch-output-tokens",
            "100",
            "--json",
        ],
        capsys,
    )
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["estimate"] is True and report["note"].startswith("Estimates, not measurements")
    assert set(report) == {
        "request",
        "model",
        "gpu",
        "factors",
        "memory",
        "performance",
        "economics",
        "fleet",
        "budget",
        "batch_job",
        "warnings",
        "estimate",
        "note",
        "pd",
    }
    assert report["pd"] is None  # without --pd
    for section in ("memory", "performance", "fleet", "batch_job", "economics"):
        assert report[section]["wrong_if"], section
    for section in ("memory", "performance", "fleet", "batch_job"):
        assert "estimate" in report[section]["basis"] or "roofline" in report[section]["basis"]
    assert report["memory"]["kv_bytes_per_token"] == 131072
    assert report["fleet"]["size"]["gpus"] == report["fleet"]["size"]["replicas"]
    assert report["performance"]["decode"][0] == {
        "batch": 1,
        "tpot_ms": pytest.approx(6.66, abs=0.01),
        "tokens_per_s": pytest.approx(150, abs=1),
        "tokens_per_s_per_stream": pytest.approx(150, abs=1),
        "bound": "memory",
    }


def test_table_output_names_every_section(capsys):
    code, out, _ = run_cli(
        [
            "--model",
            "llama-3.1-70b",
            "--gpu",
            "h100",
            "--concurrent-streams",
            "64",
            "--tokens-per-s-each",
            "20",
            "--gpus",
            "16",
            "--gpu-hour-usd",
            "3",
            "--api-usd-per-m-input",
            "3",
            "--api-usd-per-m-output",
            "15",
        ],
        capsys,
    )
    assert code == 0
    for heading in (
        "estimates, not measurements",
        "Memory per replica (bf16 weights, bf16 KV, context 8,192)",
        "KV cache per token       327,680 B",
        "Throughput per replica",
        "Fleet for 64 streams (SLO: TPOT <= 50.0 ms",
        "GPU budget of 16 GPUs",
        "Economics: $3/GPU-hour, 60% average utilisation",
        "break-even utilisation",
        "What would make these wrong",
        "Assumed factors: gpu_memory_utilization=0.9",
    ):
        assert heading in out, heading
    assert max(len(line) for line in out.splitlines()) <= 100


def test_cli_error_exits_2_naming_the_flag(capsys):
    code, out, err = run_cli(["--model", "llama-3.1-8b", "--gpu", "h800"], capsys)
    assert code == 2 and out == ""
    assert err == (
        "hpcserve plan: error: --gpu: unknown GPU 'h800'; known: a100, b200, h100, h200, l40s, "
        "mi300x\n"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"context": -5}, "--context: must be a positive integer, got -5"),
        ({"tp": 0}, "--tp: must be a positive integer, got 0"),
        (
            {"requests_per_s": -1.0, "prompt_tokens": 1, "output_tokens": 1},
            "--requests-per-s: must be > 0, got -1.0",
        ),
        ({"spares": -1}, "--spares: must be >= 0, got -1"),
        ({"utilisation": 0}, "--utilisation: must be in (0, 1], got 0"),
        ({"weights_dtype": "int8"}, "--weights-dtype: 'int8' is not one of fp16, bf16, fp8, int4"),
        ({"gpu": "h800"}, "--gpu: unknown GPU 'h800'; known: a100, b200, h100, h200, l40s, mi300x"),
        (
            {"model": "gpt-5"},
            "--model: 'gpt-5' is neither a catalog model (llama-3.1-8b, llama-3.1-70b, mixtral-8x7b)",
        ),
        ({"concurrent_streams": 10}, "--concurrent-streams: also needs --tokens-per-s-each"),
        (
            {"requests_per_s": 2.0, "output_tokens": 10},
            "--requests-per-s, --output-tokens: also needs --prompt-tokens",
        ),
        (
            {
                "concurrent_streams": 1,
                "tokens_per_s_each": 1.0,
                "requests_per_s": 1.0,
                "prompt_tokens": 1,
                "output_tokens": 1,
            },
            "--concurrent-streams and --requests-per-s describe two workloads; give one",
        ),
        (
            {"requests_per_s": 1.0, "prompt_tokens": 8000, "output_tokens": 500},
            "--prompt-tokens + --output-tokens: 8000 + 500 exceeds --context 8192",
        ),
        (
            {"batch_docs": 10},
            "--batch-docs: also needs --batch-input-tokens, --batch-output-tokens",
        ),
        ({"batch_window_h": 2.0}, "--batch-window-h: needs a batch job"),
        (
            {"tp": 3},
            "--tp: 3 does not split llama-3.1-8b's 32 attention heads and 8 KV heads evenly",
        ),
        (
            {"model": "llama-3.1-70b", "tp": 1},
            "--tp: at TP=1, llama-3.1-70b needs 131.4 GiB of weights per GPU and H100 SXM 80GB has 69.6 GiB usable",
        ),
        (
            {"model": "llama-3.1-70b", "gpus_per_node": 1},
            "--model: llama-3.1-70b does not fit on up to 1 x H100 SXM 80GB (--gpus-per-node) at any TP: it needs 131.4 GiB",
        ),
        ({"batch": 999}, "--batch: 999 exceeds the largest batch of this replica, 54 (KV cache"),
        ({"model": "llama-3.1-70b", "gpus": 2}, "--gpus: 2 GPUs hold no replica of TP=4"),
    ],
)
def test_bad_input_names_flag_value_and_rule(change, message):
    with pytest.raises(PlanError) as err:
        plan(PlanRequest(**{**CHAT, **change}))
    assert message in str(err.value)


def test_chat_streams_fleet_by_hand():
    report = plan(PlanRequest(**CHAT, concurrent_streams=200, tokens_per_s_each=30.0))
    fleet = report.fleet
    assert fleet is not None and fleet.slo_met
    # TPOT <= 1/30 s at 8,192 tokens of context: the whole KV cache (54) fits in it.
    assert fleet.batch_per_replica == report.memory.max_seqs == 54 and fleet.tpot_ms < 1000 / 30
    assert fleet.size.replicas_needed == math.ceil(200 / (54 * 0.85)) == 5
    assert (fleet.size.replicas, fleet.size.gpus, fleet.size.nodes) == (6, 6, 1)
    # Spread over the 5 serving replicas, 200 streams are 40 each: batch 40, a faster TPOT.
    assert fleet.demand_per_replica == 40 and fleet.batch_at_demand == 40
    assert fleet.tpot_ms_at_demand < fleet.tpot_ms


def test_requests_settle_where_littles_law_puts_them():
    report = plan(PlanRequest(**CHAT, requests_per_s=4.0, prompt_tokens=1500, output_tokens=350))
    fleet = report.fleet
    assert fleet is not None and fleet.size.replicas_needed == 1
    # In flight = arrival rate x time in decode = 4/s x 350 x TPOT; the replica settles at the
    # smallest batch that holds it (TPOT grows with batch, so B - 1 would not).
    in_flight = 4.0 * 350 * fleet.tpot_ms_at_demand / 1e3
    assert fleet.batch_at_demand - 1 < in_flight <= fleet.batch_at_demand


def test_a_latency_target_picks_a_larger_tp_or_warns():
    fast = plan(PlanRequest(model="llama-3.1-70b", gpu="h100", tpot_slo_ms=12.0))
    assert fast.memory.tp == 8 and "meets the latency target" in fast.memory.tp_reason
    slow = plan(
        PlanRequest(
            model="llama-3.1-70b",
            gpu="l40s",
            tpot_slo_ms=5.0,
            concurrent_streams=4,
            tokens_per_s_each=10.0,
        )
    )
    assert slow.fleet is not None and not slow.fleet.slo_met
    assert any("is not met at TP=" in w for w in slow.warnings)
    assert any("no TP up to 8 meets the latency target" in w for w in slow.warnings)


def test_extraction_batch_job_gpu_hours_are_consistent():
    report = plan(PlanRequest(**EXTRACTION))
    assert report.memory.tp == 4 and report.batch_job is not None
    job = report.batch_job.job
    assert job.gpu_hours == pytest.approx(1e6 / job.docs_per_s_per_replica / 3600 * 4)
    assert job.gpus_for_window == 4 * math.ceil(job.replica_hours / 24)
    assert job.hours_on_budget == pytest.approx(job.replica_hours / 4)
    assert job.fits_window is (job.hours_on_budget <= 24)
    assert report.batch_job.cost_usd == pytest.approx(job.gpu_hours * 2.5)
    assert report.batch_job.api_cost_usd is None
    priced = plan(PlanRequest(**EXTRACTION, api_usd_per_m_input=0.6, api_usd_per_m_output=0.8))
    assert priced.batch_job.api_cost_usd == pytest.approx(1e6 * (3000 * 0.6 + 500 * 0.8) / 1e6)


def test_moe_and_hf_config_models_plan(tmp_path):
    moe = plan(PlanRequest(model="mixtral-8x7b", gpu="h100", context=4096))
    assert moe.model.params_active < moe.model.params_total and moe.memory.tp == 2
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tiny = plan(PlanRequest(model=str(tmp_path), gpu="l40s"))
    assert tiny.memory.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2
    assert tiny.model.source.endswith("config.json")


def test_calibration_replaces_the_roofline(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(CALIBRATION))
    request = PlanRequest(
        **CHAT, calibrate=str(path), concurrent_streams=100, tokens_per_s_each=40.0
    )
    report = plan(request)
    perf = report.performance
    assert perf.basis.startswith("measured") and perf.single_stream_bound_tps is None
    rows = {row.batch: row for row in perf.decode}
    assert rows[1].tokens_per_s == pytest.approx(100) and rows[32].tokens_per_s == pytest.approx(
        1600
    )
    assert perf.prefill_tokens_per_s == pytest.approx(20000)
    # TPOT <= 25 ms: beyond batch 32, 1,600 tok/s holds, so TPOT = B / 1600 -> B = 40.
    assert report.fleet is not None and report.fleet.batch_per_replica == 40
    assert report.fleet.size.replicas == math.ceil(100 / (40 * 0.85)) + 1 == 4
    with pytest.raises(PlanError, match=r"tp: measured 1 but the plan uses 2 \(--tp\)"):
        plan(msgspec.structs.replace(request, tp=2))


def test_economics_section_prices_the_fleet():
    report = plan(
        PlanRequest(
            **CHAT,
            requests_per_s=20.0,
            prompt_tokens=1000,
            output_tokens=300,
            gpu_hour_usd=2.0,
            api_usd_per_m_input=0.2,
            api_usd_per_m_output=0.6,
        )
    )
    costs, fleet = report.economics.costs, report.fleet
    assert fleet is not None and not report.economics.placeholder_price
    assert costs.gpus_billed == fleet.size.gpus and costs.monthly_usd == fleet.size.gpus * 2.0 * 730
    assert costs.break_even_workload == pytest.approx(
        (fleet.size.gpus * 2.0 / 3600 / (fleet.size.replicas_needed * fleet.capacity_per_replica))
        / ((1000 * 0.2 + 300 * 0.6) / 1e6)
    )
    placeholder = plan(PlanRequest(**CHAT)).economics
    assert placeholder.placeholder_price and placeholder.costs.gpu_hour_usd == 2.5


def test_factors_are_validated_and_used():
    with pytest.raises(PlanError, match=r"factors.hbm_efficiency: must be in \(0, 1\], got 1.5"):
        Factors(hbm_efficiency=1.5)
    slower = plan(PlanRequest(**CHAT), Factors(hbm_efficiency=0.4))
    assert (
        slower.performance.decode[0].tokens_per_s
        < plan(PlanRequest(**CHAT)).performance.decode[0].tokens_per_s
    )
