"""The planner's PD model: links, mixes, colocated vs disaggregated goodput, the CLI."""

import argparse
import json
import math

import pytest

from hpcserve.planner import (
    MODELS,
    Factors,
    PlanError,
    PlanRequest,
    Replica,
    Roofline,
    get_gpu,
    memory_fit,
    plan,
)
from hpcserve.planner.cli import add_plan_parser
from hpcserve.planner.pd import (
    LINKS,
    Engine,
    Shape,
    _erlang_c,
    _wait_tail,
    colocated,
    compare,
    disaggregated,
    get_link,
    goodput,
    parse_mix,
    prefill_service_s,
)
from hpcserve.planner.perfmodel import StepBatch, StepTime
from hpcserve.planner.replica import kv_bytes_per_token

LONG_MIX = "3000:150:0.5,400:150:0.5"
SLO = {"ttft_s": 0.8, "tpot_s": 0.05}


class LinearModel:
    """10 ms per step + 0.1 ms per decoding sequence + 0.05 ms per prompt token."""

    basis = "fake"

    def step_time(self, batch: StepBatch) -> StepTime:
        if batch.tokens <= 0:
            return StepTime(0.0)
        return StepTime(0.010 + 1e-4 * batch.decode_seqs + 5e-5 * batch.prefill_tokens)


def h100_8b():
    factors = Factors()
    replica = Replica(MODELS["llama-3.1-8b"], get_gpu("h100"))
    engine = Engine(
        factors.max_num_batched_tokens, factors.max_num_seqs, memory_fit(replica, factors).kv_tokens
    )
    return Roofline(replica, factors), engine, kv_bytes_per_token(replica.model, "bf16")


# ---- links and mixes ----


@pytest.mark.parametrize(
    ("name", "nbytes", "ms"),
    [
        ("ib", 40e6, 1.1),  # 100 us + 40 MB at 40 GB/s
        ("nvlink", 360e6, 1.02),
        ("ethernet", 8.75e6, 1.5),
    ],
)
def test_link_transfer_time(name, nbytes, ms):
    assert LINKS[name].transfer_s(nbytes) * 1e3 == pytest.approx(ms)


def test_link_overrides_and_unknown_link():
    link = get_link("IB", gb_s=10, latency_us=0)
    assert (link.gb_s, link.latency_s) == (10, 0)
    assert link.transfer_s(1e9) == pytest.approx(0.1)
    with pytest.raises(PlanError, match="--pd-link: unknown link 'tcp'; known: nvlink"):
        get_link("tcp")


@pytest.mark.parametrize(
    ("text", "shapes"),
    [
        ("3000:150", [Shape(3000, 150, 1.0)]),
        ("3000:150:1,400:150:3", [Shape(3000, 150, 0.25), Shape(400, 150, 0.75)]),
        (" 100:20:0.5 , 200:30:0.5 ", [Shape(100, 20, 0.5), Shape(200, 30, 0.5)]),
    ],
)
def test_parse_mix(text, shapes):
    assert parse_mix(text) == shapes


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("3000", "not PROMPT:OUTPUT"),
        ("3000:x", "not PROMPT:OUTPUT"),
        ("3000:150:0.5:1", "not PROMPT:OUTPUT"),
        ("0:150", "prompt must be >= 1"),
        ("100:1", "output >= 2"),
        ("100:20:0", "share > 0"),
    ],
)
def test_parse_mix_errors_name_the_flag(text, match):
    with pytest.raises(PlanError, match=f"--pd-mix: .*{match}"):
        parse_mix(text)


# ---- the model, on a fake step model whose figures are checked by hand ----


def test_disaggregated_at_a_trickle_is_service_plus_transfer_plus_decode_steps():
    model, engine = LinearModel(), Engine(8192, 256, 10**6)
    link = get_link("ib", gb_s=1, latency_us=0)
    out = disaggregated(
        model, engine, [Shape(1000, 100)], 1e-6, prefill=1, decode=1, link=link,
        kv_bytes_per_token=1e5,
    )  # fmt: skip
    service = 0.010 + 0.05  # one step of 1000 prompt tokens
    assert prefill_service_s(model, 1000, 8192) == pytest.approx(service)
    # TTFT: the prompt (no queue), 100 MB at 1 GB/s, 1.5 decode steps of batch 1.
    assert out.ttft_p95_s == pytest.approx(service + 0.1 + 1.5 * 0.0101, rel=1e-3)
    assert out.tpot_p95_s == out.itl_p95_s == pytest.approx(0.0101, rel=1e-3)
    assert out.stable


@pytest.mark.parametrize(
    ("servers", "offered", "waits"),
    [(1, 0.5, 0.5), (2, 1.0, 1 / 3), (3, 2.4, 0.6472)],  # M/M/1: rho; Erlang C tables
)
def test_erlang_c(servers, offered, waits):
    assert _erlang_c(servers, offered) == pytest.approx(waits, abs=1e-4)


def test_queue_wait_tail_mg1_and_pooled():
    # M/D/1 at rho 0.5 (10/s x 50 ms): mean wait 25 ms, P(wait > 0) = 0.5.
    tail = _wait_tail(10.0, [(1.0, 0.05)])
    assert tail(0.0) == pytest.approx(0.5)
    assert tail(0.05) == pytest.approx(0.5 * math.exp(-0.5 * 0.05 / 0.025))
    # One queue in front of 3 servers waits less than each of 3 queues at a third the rate.
    pooled, split = _wait_tail(30.0, [(1.0, 0.05)], 3), _wait_tail(10.0, [(1.0, 0.05)])
    assert pooled(0.05) < split(0.05) / 2
    assert _wait_tail(30.0, [(1.0, 0.05)], 1)(10.0) == 1.0  # rho >= 1: every wait is long


def test_prompts_longer_than_the_budget_are_chunked():
    model = LinearModel()
    # 3 steps of 1000, 1000 and 500 tokens: three step overheads.
    assert prefill_service_s(model, 2500, 1000) == pytest.approx(3 * 0.010 + 2500 * 5e-5)


def test_colocated_prompts_stall_decode_steps():
    model, engine = LinearModel(), Engine(8192, 256, 10**6)
    mix = [Shape(3000, 100)]
    light, heavy = (colocated(model, engine, mix, rate) for rate in (0.5, 4.0))
    assert light.tpot_p95_s < heavy.tpot_p95_s
    # Every step that holds a 3000-token prompt takes 150 ms more: at 4 prompts/s, over 5%
    # of the steps do, so the per-token p95 is such a step, far above the request mean.
    assert heavy.itl_p95_s > 0.15 > heavy.tpot_p95_s


def test_overload_is_unstable_and_goodput_finds_the_edge():
    model, engine = LinearModel(), Engine(8192, 256, 10**6)
    mix = [Shape(3000, 100)]
    assert not colocated(model, engine, mix, 100.0).stable  # 100 x 150 ms of prompt per s
    rate = goodput(lambda r: colocated(model, engine, mix, r), **SLO)
    assert 0 < rate < 1 / 0.15
    assert colocated(model, engine, mix, rate).meets(**SLO)
    assert not colocated(model, engine, mix, rate * 1.05).meets(**SLO)


def test_goodput_is_zero_when_no_rate_meets_the_slo():
    model, engine = LinearModel(), Engine(8192, 256, 10**6)
    assert goodput(lambda r: colocated(model, engine, [Shape(30000, 10)], r), **SLO) == 0.0


# ---- the comparison on the roofline (llama-3.1-8b on H100) ----


@pytest.mark.parametrize(
    ("mix", "per_token", "replicas", "pays", "ratio"),
    [
        # Long prompts, every token gap held to 50 ms: one 3k prompt stalls a step past it.
        (LONG_MIX, True, 4, True, (3, 1)),
        (LONG_MIX, True, 8, True, (6, 2)),
        # The request's mean gap: colocated steps absorb the prompts (chunked prefill).
        (LONG_MIX, False, 4, False, (3, 1)),
        # Short chat prompts: nothing to separate.
        ("200:150", False, 4, False, (2, 2)),
        ("200:150", True, 4, False, (2, 2)),
    ],
)
def test_compare_verdicts(mix, per_token, replicas, pays, ratio):
    model, engine, kv = h100_8b()
    c = compare(
        model, engine, parse_mix(mix), replicas=replicas, link=LINKS["ib"],
        kv_bytes_per_token=kv, ttft_s=0.8, tpot_s=0.05, per_token=per_token,
    )  # fmt: skip
    assert c.pays is pays
    assert (c.prefill, c.decode) == ratio
    assert len(c.splits) == replicas - 1
    assert c.pd_rps == max(s.goodput_rps for s in c.splits)
    assert c.gain == pytest.approx(c.pd_rps / c.colocated_rps - 1)


def test_compare_needs_two_replicas():
    model, engine, kv = h100_8b()
    with pytest.raises(PlanError, match="at least 2 replicas"):
        compare(
            model, engine, [Shape(100, 10)], replicas=1, link=LINKS["ib"],
            kv_bytes_per_token=kv, ttft_s=0.8, tpot_s=0.05,
        )  # fmt: skip


def test_a_slow_link_costs_pd_its_ttft():
    model, engine, kv = h100_8b()
    shapes = parse_mix(LONG_MIX)

    def ttft(link):
        return disaggregated(
            model, engine, shapes, 10.0, prefill=3, decode=1, link=link, kv_bytes_per_token=kv
        ).ttft_p95_s

    slow = get_link("ethernet", gb_s=0.5)  # 3000 x 128 KiB = 393 MB: ~0.8 s
    assert ttft(slow) - ttft(LINKS["nvlink"]) == pytest.approx(0.78, abs=0.02)


# ---- plan() and the CLI ----


def pd_request(**extra):
    fields = {
        "model": "llama-3.1-8b",
        "gpu": "h100",
        "requests_per_s": 40,
        "prompt_tokens": 3000,
        "output_tokens": 150,
        "ttft_slo_ms": 800,
        "tpot_slo_ms": 50,
        "gpus": 4,
        "pd": True,
    }
    return PlanRequest(**(fields | extra))


def test_plan_pd_section():
    report = plan(pd_request(pd_mix=LONG_MIX, pd_per_token=True))
    assert report.pd is not None
    assert (report.pd.gpus, report.pd.replicas, report.pd.ratio) == (4, 4, "3:1")
    assert report.pd.kv_bytes_per_token == 131072  # 2 x 32 layers x 8 heads x 128 x 2 B
    assert report.pd.comparison.pays
    assert report.pd.verdict.startswith("PD pays: 3:1 serves +")
    single = plan(pd_request()).pd  # the requests workload's shape: 3000 -> 150
    assert single is not None and not single.comparison.pays
    assert single.verdict.startswith("PD does not pay: the best split (3:1) serves ")
    assert single.verdict.endswith("% less goodput than colocated replicas")
    assert plan(PlanRequest(model="llama-3.1-8b", gpu="h100")).pd is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"pd_mix": "100:10"}, "--pd-mix: only with --pd"),
        ({"pd_per_token": True}, "--pd-per-token: only with --pd"),
        ({"pd": True, "ttft_slo_ms": 800}, "--pd: needs --tpot-slo-ms"),
        ({"pd": True, "ttft_slo_ms": 800, "tpot_slo_ms": 50}, "--pd: needs a request mix"),
        ({"pd": True, "pd_mix": "1:2", "pd_link_gb_s": 0}, "--pd-link-gb-s: must be > 0"),
    ],
)
def test_pd_request_errors_name_the_flag(fields, match):
    with pytest.raises(PlanError, match=match):
        PlanRequest(model="llama-3.1-8b", gpu="h100", **fields)


def test_plan_pd_errors():
    with pytest.raises(PlanError, match="--pd: 1 GPUs hold 1 replica"):
        plan(pd_request(gpus=1))
    with pytest.raises(PlanError, match="--pd-link: unknown link"):
        plan(pd_request(pd_link="carrier-pigeon"))
    with pytest.raises(PlanError, match="--pd-mix: a request of 9,100 tokens exceeds"):
        plan(pd_request(pd_mix="9000:100"))


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="hpcserve")
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


COMMON = [
    "--model", "llama-3.1-8b", "--gpu", "h100", "--requests-per-s", "40",
    "--prompt-tokens", "3000", "--output-tokens", "150", "--ttft-slo-ms", "800",
    "--tpot-slo-ms", "50", "--gpus", "4", "--pd", "--pd-mix", LONG_MIX,
]  # fmt: skip


def test_cli_table_and_json(capsys):
    code, out, _ = run_cli([*COMMON, "--pd-per-token", "--pd-link", "roce"], capsys)
    assert code == 0
    assert "Disaggregated prefill/decode on 4 GPUs (4 replicas)" in out
    assert "RoCE 200 Gb/s" in out
    assert "every token gap (ITL p95)" in out
    assert "=> PD pays: 3:1 serves +" in out
    code, out, _ = run_cli([*COMMON, "--json"], capsys)
    assert code == 0
    pd = json.loads(out)["pd"]
    assert pd["ratio"] == "3:1" and pd["comparison"]["pays"] is False
    assert pd["link"] == {"name": "InfiniBand NDR 400 Gb/s", "gb_s": 40.0, "latency_s": 1e-4}
    assert math.isclose(sum(s["share"] for s in pd["mix"]), 1.0)


def test_cli_bad_pd_input_exits_2(capsys):
    code, _, err = run_cli([*COMMON[:-2], "--pd-mix", "3000"], capsys)
    assert code == 2
    assert "hpcserve plan: error: --pd-mix: '3000' is not PROMPT:OUTPUT" in err
