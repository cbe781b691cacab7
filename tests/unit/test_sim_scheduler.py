"""The simulator's scheduler and timing: token budget, chunked prefill, preemption, roofline."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from starlette.requests import Request

from hpcserve.planner.errors import PlanError
from hpcserve.planner.factors import Factors
from hpcserve.planner.gpus import get_gpu
from hpcserve.planner.models import MODELS
from hpcserve.planner.perfmodel import Roofline, decode_step, prefill_chunk
from hpcserve.planner.replica import Replica, memory_fit
from hpcserve.sim.kvcache import KVCache
from hpcserve.sim.options import OptionsError, add_arguments, sim_config
from hpcserve.sim.scheduler import Scheduler, SchedulerLimits, SimRequest, Status
from hpcserve.sim.server import request_priority
from hpcserve.sim.timing import FixedStep, hardware


def make(blocks: int = 64, block: int = 4, **limits: Any) -> Scheduler:
    return Scheduler(KVCache(blocks, block), SchedulerLimits(**limits), lambda r: 7)


def run_to_end(
    s: Scheduler,
    steps: int = 1000,
    *,
    first_step: int = 0,
    preempted: list[SimRequest] | None = None,
) -> int:
    """Step n at time n until nothing is left; the step it ended at. `preempted` collects
    the requests preempted on the way."""
    for n in range(first_step, first_step + steps):
        if not s.has_work:
            return n
        plan = s.schedule()
        if preempted is not None:
            preempted += plan.preempted
        s.complete(plan, float(n))
    raise AssertionError("did not finish")


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    s = make(max_num_batched_tokens=8)
    req = SimRequest("a", list(range(20)), max_tokens=3)
    s.add(req)
    plan = s.schedule()
    assert [(i.tokens, i.offset) for i in plan.scheduled] == [(8, 0)]
    assert plan.batch == prefill_chunk(8, 0)
    assert s.complete(plan, 0.0) == [(req, None)]
    s.complete(s.schedule(), 1.0)
    plan = s.schedule()  # the last 4 prompt tokens, then the first output token
    assert plan.batch == prefill_chunk(4, 16)
    assert s.complete(plan, 2.0) == [(req, 7)]
    assert req.first_token_s == 2.0
    plan = s.schedule()
    assert plan.batch == decode_step(1, 20)
    run_to_end(s)
    assert req.status is Status.FINISHED and req.output_ids == [7, 7, 7]
    assert req.finish_reason == "length"


def test_decodes_go_first_and_new_prompts_fill_the_rest_of_the_budget() -> None:
    s = make(max_num_batched_tokens=10, max_num_seqs=2)
    a, b, c = (SimRequest(x, [ord(x)] * 8, max_tokens=5) for x in "abc")
    s.add(a)
    s.complete(s.schedule(), 0.0)  # a prefilled, first token out
    s.add(b)
    s.add(c)
    plan = s.schedule()
    assert [(i.request.request_id, i.tokens) for i in plan.scheduled] == [("a", 1), ("b", 8)]
    assert plan.batch.decode_seqs == 1 and plan.batch.prefill_tokens == 8
    assert list(s.waiting) == [c]  # max_num_seqs


def test_a_shared_prefix_is_not_computed_again() -> None:
    s = make(block=4)
    s.add(SimRequest("a", list(range(16)), max_tokens=1))
    run_to_end(s)
    b = SimRequest("b", [*range(12), 99, 98, 97], max_tokens=1)
    s.add(b)
    plan = s.schedule()
    assert b.cached_tokens == 12
    assert plan.batch == prefill_chunk(3, 12)


def test_when_kv_runs_out_the_last_started_request_is_preempted_and_recomputed() -> None:
    s = make(blocks=6, block=4, max_num_batched_tokens=64)
    a = SimRequest("a", list(range(8)), max_tokens=8)  # 16 tokens = 4 blocks at the end
    b = SimRequest("b", list(range(50, 58)), max_tokens=8)
    s.add(a)
    s.add(b)
    preempted: list[SimRequest] = []
    run_to_end(s, 200, preempted=preempted)
    assert b in preempted and a not in preempted
    assert a.status is b.status is Status.FINISHED
    assert len(a.output_ids) == len(b.output_ids) == 8
    assert s.preemptions == b.preemptions >= 1
    assert s.kv.usage == 0.0


def _request(name: str, priority: int, arrival_s: float, prompt: int = 8) -> SimRequest:
    base = 100 * (ord(name[0]) - ord("a"))
    return SimRequest(
        name, list(range(base, base + prompt)), 8, arrival_s=arrival_s, priority=priority
    )


def _admitted(s: Scheduler) -> list[str]:
    return [i.request.request_id for i in s.schedule().scheduled]


@pytest.mark.parametrize(
    ("policy", "first"),
    [("priority", ["i"]), ("fcfs", ["b1"])],
)
def test_the_priority_policy_admits_a_lower_priority_value_first(
    policy: str, first: list[str]
) -> None:
    s = make(max_num_seqs=1, policy=policy)
    s.add(_request("b1", 1, 0.0))
    s.add(_request("b2", 1, 1.0))
    s.add(_request("i", 0, 2.0))  # arrives last, interactive
    assert _admitted(s) == first


def test_equal_priorities_are_served_in_arrival_order() -> None:
    s = make(max_num_seqs=1, policy="priority")
    for name, arrival in (("c", 3.0), ("a", 1.0), ("b", 2.0)):
        s.add(_request(name, 5, arrival))
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]


def test_kv_shortage_preempts_the_lowest_priority_request_not_the_last_started() -> None:
    # b (batch) started first and a (interactive) second: fcfs would preempt a.
    s = make(blocks=6, block=4, max_num_batched_tokens=64, policy="priority")
    b, a = _request("b", 1, 0.0), _request("a", 0, 1.0)
    s.add(b)
    s.complete(s.schedule(), 0.0)
    s.add(a)
    preempted: list[SimRequest] = []
    run_to_end(s, 199, first_step=1, preempted=preempted)
    assert b in preempted and a not in preempted
    assert a.finished_s < b.finished_s
    assert len(a.output_ids) == len(b.output_ids) == 8
    assert s.kv.usage == 0.0


def test_a_victim_already_scheduled_in_the_step_gives_its_tokens_back() -> None:
    # b (batch) runs ahead of a in the running list; in step 3 b fits but a needs a third
    # block and none is free: b, already in the plan, is preempted and leaves it.
    s = make(blocks=4, block=4, max_num_batched_tokens=64, policy="priority")
    b = SimRequest("b", list(range(6)), 8, arrival_s=0.0, priority=1)
    a = SimRequest("a", list(range(50, 58)), 8, arrival_s=1.0, priority=0)
    s.add(b)
    s.complete(s.schedule(), 0.0)
    s.add(a)
    s.complete(s.schedule(), 1.0)
    assert s.running == [b, a] and s.kv.free_blocks == 0
    plan = s.schedule()
    assert plan.preempted == [b]
    assert [(i.request, i.tokens) for i in plan.scheduled] == [(a, 1)]
    assert plan.batch == decode_step(1, 8)
    assert b.status is Status.WAITING and b.num_computed == 0 and not s.kv.holds("b")


def test_a_preempted_request_waits_behind_higher_priority_ones() -> None:
    s = make(policy="priority")
    i = _request("i", 0, 5.0)
    s.add(i)
    b = _request("b", 1, 0.0)
    b.status = Status.RUNNING
    s._preempt(b)
    assert list(s.waiting) == [i, b]
    f = make(policy="fcfs")
    f.add(i)
    f._preempt(b)
    assert list(f.waiting) == [b, i]  # fcfs: the head of the queue


def test_the_scheduling_policy_flag_is_checked() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--served-model-name", "m", "--scheduling-policy", "lifo"])
    with pytest.raises(OptionsError, match="--scheduling-policy: 'lifo'"):
        sim_config(args)
    args = parser.parse_args(["--served-model-name", "m", "--scheduling-policy", "priority"])
    assert sim_config(args).limits.policy == "priority"


def test_a_prompt_larger_than_the_cache_or_the_context_is_refused() -> None:
    s = make(blocks=2, block=4, max_model_len=100)
    with pytest.raises(ValueError, match="more KV blocks"):
        s.add(SimRequest("a", list(range(9)), max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len 100"):
        s.add(SimRequest("b", list(range(100)), max_tokens=1))


def test_aborting_frees_the_blocks() -> None:
    s = make()
    req = SimRequest("a", list(range(10)), max_tokens=50)
    s.add(req)
    s.complete(s.schedule(), 0.0)
    s.abort(req)
    assert req.status is Status.FINISHED and req.finish_reason == "abort"
    assert not s.has_work and s.kv.usage == 0.0


def test_the_simulator_prices_steps_with_the_planners_roofline() -> None:
    hw = hardware("h100", "llama-3.1-8b")
    replica = Replica(MODELS["llama-3.1-8b"], get_gpu("h100"))
    planner = Roofline(replica, Factors())
    assert hw.kv_blocks == memory_fit(replica, Factors()).kv_blocks
    assert hw.block_size == 16
    for batch in (decode_step(32, 2000), prefill_chunk(2048, 0)):
        assert hw.step_model.step_time(batch) == planner.step_time(batch)
    # decode is bandwidth-bound, a long prefill compute-bound
    assert hw.step_model.step_time(decode_step(8, 1000)).bound == "memory"
    assert hw.step_model.step_time(prefill_chunk(4096, 0)).bound == "compute"
    faster = hardware("h200", "llama-3.1-8b").step_model.step_time(decode_step(8, 1000))
    assert faster.total_s < hw.step_model.step_time(decode_step(8, 1000)).total_s


def test_hardware_errors_name_the_flag() -> None:
    with pytest.raises(PlanError, match="--sim-gpu: unknown GPU 'v100'"):
        hardware("v100", "llama-3.1-8b")
    with pytest.raises(PlanError, match="does not fit"):
        hardware("l40s", "llama-3.1-70b")
    with pytest.raises(PlanError, match="--sim-kv-dtype: 'int4'"):
        hardware("h100", "llama-3.1-8b", kv_dtype="int4")


def test_fp8_weights_and_kv_make_decode_faster_and_the_cache_bigger() -> None:
    bf16 = hardware("h100", "llama-3.1-8b")
    fp8 = hardware("h100", "llama-3.1-8b", weights_dtype="fp8", kv_dtype="fp8")
    assert fp8.kv_blocks > 2 * bf16.kv_blocks
    batch = decode_step(8, 1000)
    assert fp8.step_model.step_time(batch).total_s < bf16.step_model.step_time(batch).total_s


def test_fixed_timing_charges_prompt_tokens_and_one_cost_per_decode_step() -> None:
    fixed = FixedStep(prefill_s_per_token=0.001, decode_s=0.01)
    assert fixed.step_time(decode_step(0, 0)).total_s == 0.0
    assert fixed.step_time(prefill_chunk(100) + decode_step(5, 10)).total_s == pytest.approx(0.11)


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({}, {}, 0),
        ({}, {"priority": 3}, 3),
        ({"x-vllm-priority": "1"}, {"priority": -5}, 1),  # vLLM's header wins over the body
        ({"X-Vllm-Priority": "high"}, {"priority": 2}, 2),  # not an integer: ignored
    ],
)
def test_the_sim_server_reads_priority_as_vllm_does(
    headers: dict[str, str], body: dict[str, Any], expected: int
) -> None:
    scope = {
        "type": "http",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    assert request_priority(Request(scope), body) == expected
    with pytest.raises(ValueError, match="priority must be an integer"):
        request_priority(Request({"type": "http", "headers": []}), {"priority": "1"})
