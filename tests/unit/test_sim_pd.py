"""sim/pd.py: colocated and disaggregated replicas in modelled time, on fixed timing."""

import pytest

from hpcserve.planner.pd import Link, Shape
from hpcserve.sim.pd import (
    Arrival,
    Layout,
    PDRun,
    RunResult,
    latencies,
    percentile,
    poisson_arrivals,
)
from hpcserve.sim.scheduler import SchedulerLimits
from hpcserve.sim.timing import fixed_hardware, hardware

# 1 ms per prompt token, 10 ms per step that decodes; 1,000 blocks of 16 tokens.
HW = fixed_hardware(1e-3, 10e-3, kv_blocks=1000, block_size=16)
LIMITS = SchedulerLimits(max_num_seqs=64, max_num_batched_tokens=8192)
# 5 ms per transfer + 1 MB per token at 10 GB/s: 0.1 ms per prompt token.
LINK = Link("test link", 10.0, 5e-3)
PD = Layout(2, prefill=1, link=LINK, kv_bytes_per_token=1e6)


def run(layout, arrivals, hw=HW):
    return PDRun(hw, LIMITS, layout).run(arrivals)


def test_colocated_single_request_timeline():
    result = run(Layout(1), [Arrival(0.0, 100, 5)])
    (o,) = result.outcomes
    assert o.ttft_s == pytest.approx(0.100)  # one step of 100 prompt tokens
    assert o.gaps == pytest.approx([0.010] * 4)
    assert o.tpot_s == pytest.approx(0.010)
    assert result.prompt_tokens_by_role == {"both": 100}


def test_pd_single_request_pays_the_transfer_and_does_not_recompute_the_prompt():
    result = run(PD, [Arrival(0.0, 100, 5)])
    (o,) = result.outcomes
    # Prefill 100 ms, transfer 5 ms + 100 x 0.1 ms, then the decode replica computes only
    # the last prompt token (1 ms) for its first token.
    assert o.ttft_s == pytest.approx(0.100 + 0.015 + 0.001)
    assert o.gaps == pytest.approx([0.010] * 4)
    assert result.prompt_tokens_by_role == {"prefill": 100, "decode": 1}


def test_a_long_prompt_stalls_colocated_decode_but_not_pd_decode():
    arrivals = [Arrival(0.0, 10, 500), Arrival(0.1, 2000, 2)]

    def chat_gaps(layout):
        result = run(layout, arrivals)
        return next(o for o in result.outcomes if o.prompt == 10).gaps

    assert max(chat_gaps(Layout(2))) == pytest.approx(0.010)  # two replicas: no sharing
    assert max(chat_gaps(Layout(1))) == pytest.approx(2.010)  # one step holds the prompt
    # PD: the chat decodes beside the long request's one-token step, never its prompt.
    assert max(chat_gaps(PD)) == pytest.approx(0.011)


def test_colocated_goes_to_the_least_loaded_replica():
    result = run(Layout(2), [Arrival(0.0, 100, 50), Arrival(0.001, 100, 50)])
    _, second = sorted(result.outcomes, key=lambda o: o.arrival_s)
    assert second.ttft_s == pytest.approx(0.100)  # its own replica: no wait


def test_transfers_wait_for_decode_kv_blocks():
    small = fixed_hardware(1e-4, 1e-3, kv_blocks=20, block_size=16)  # 320 tokens
    arrivals = [Arrival(i * 1e-3, 200, 20) for i in range(3)]
    result = run(PD, arrivals, hw=small)
    assert all(o.ttft_s > 0 and len(o.gaps) == 19 for o in result.outcomes)
    ttfts = sorted(o.ttft_s + o.arrival_s for o in result.outcomes)
    # One request's KV fits at a time: each waits for the one before to finish.
    assert ttfts[1] - ttfts[0] > 19 * 1e-3
    assert result.prompt_tokens_by_role["decode"] == 3


def test_decode_preemption_beside_transferred_requests_does_not_stall():
    # 40 blocks of 16: two requests of 200 + 100 tokens hold 38. Decode replicas preempt as
    # sequences grow; a preempted request (its KV dropped) must not wait forever behind
    # transferred ones holding blocks.
    tight = fixed_hardware(1e-5, 1e-3, kv_blocks=40, block_size=16)
    arrivals = [Arrival(i * 1e-3, 200, 100) for i in range(8)]
    result = run(PD, arrivals, hw=tight)
    assert result.preemptions > 0
    assert all(o.ttft_s > 0 and len(o.gaps) == 99 for o in result.outcomes)


def test_roofline_run_reports_every_request():
    hw = hardware("h100", "llama-3.1-8b")
    mix = [Shape(3000, 20, 0.5), Shape(300, 20, 0.5)]
    arrivals = poisson_arrivals(mix, 20.0, 60, seed=3)
    for layout in (Layout(2), Layout(2, 1, LINK, 131072)):
        result = PDRun(hw, LIMITS, layout).run(arrivals)
        assert len(result.outcomes) == 60
        assert all(len(o.gaps) == 19 for o in result.outcomes)
        lat = latencies(result)
        assert lat.requests == 42  # 60 less the first 20% and the last 10%
        assert min(lat.ttft_p95_s, lat.tpot_p95_s, lat.itl_p95_s) > 0
    assert result.prompt_tokens_by_role["decode"] == 60  # the PD layout's: 1 per request


def test_poisson_arrivals_are_seeded_and_drawn_by_share():
    mix = [Shape(1000, 10, 0.25), Shape(10, 10, 0.75)]
    a, b = poisson_arrivals(mix, 50.0, 2000, seed=1), poisson_arrivals(mix, 50.0, 2000, seed=1)
    assert a == b
    assert a != poisson_arrivals(mix, 50.0, 2000, seed=2)
    assert sum(x.prompt == 1000 for x in a) / 2000 == pytest.approx(0.25, abs=0.03)
    assert a[-1].at_s == pytest.approx(40.0, rel=0.1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicas": 0}, "replicas must be >= 1"),
        ({"replicas": 2, "prefill": 2, "link": LINK}, "must leave a decode replica"),
        ({"replicas": 2, "prefill": 1}, "needs a link"),
    ],
)
def test_layout_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


def test_an_overloaded_run_is_growing_and_meets_no_slo():
    # One replica: 100 ms of prompt per request, 12 requests/s, so the queue grows by 20%
    # of the elapsed time; a run at 8/s keeps up.
    def lat(rate):
        arrivals = [Arrival(i / rate, 100, 2) for i in range(200)]
        return latencies(run(Layout(1), arrivals))

    over, under = lat(12.0), lat(8.0)
    assert over.growing and not over.meets(ttft_s=100.0, tpot_s=100.0)
    assert not under.growing and under.meets(ttft_s=0.2, tpot_s=0.02)


def test_latencies_raise_on_a_request_without_a_first_token():
    result = run(Layout(1), [Arrival(0.0, 10, 3)] * 10)
    result.outcomes[5].ttft_s = -1.0
    with pytest.raises(RuntimeError, match="never got its first token"):
        latencies(RunResult("x", result.outcomes, {}, 0, 0.0), warmup=0, cooldown=0)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([], 0.95, 0.0), ([3.0], 0.95, 3.0), (list(range(1, 101)), 0.95, 95.05), ([1, 2], 0.5, 1.5)],
)
def test_percentile_between_ranks(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)
