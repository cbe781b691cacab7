"""bench/batch_throughput.py's pure parts: CPU lists for pinning engines, and the medians over
rounds (of one invocation or several combined)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.batch_throughput import (
    batch_settings,
    combine,
    cpu_list,
    has_content,
    parse_cpus,
    requests_of,
    round_directs,
    summarize_rounds,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", set()), ("0", {0}), ("1", {1}), ("0-1", {0, 1}), ("0,2-3", {0, 2, 3}), ("3,1", {1, 3})],
)
def test_cpu_lists_parse_and_print_as_taskset_and_proc_write_them(text, cpus):
    parsed = parse_cpus(text, "--batch-cpus", allowed={0, 1, 2, 3})
    assert parsed == cpus
    assert parse_cpus(cpu_list(parsed), "--batch-cpus", allowed={0, 1, 2, 3}) == cpus


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("x", "'x' is not a CPU number or range"),
        ("1-", "'1-' is not a CPU number or range"),
        ("3-1", "'3-1' is not an ascending range"),
        ("-1", "'-1' is not a CPU number or range"),
        ("0,7", "CPU 7 is not one this process may use (0-3)"),
    ],
)
def test_a_bad_cpu_list_is_an_error_naming_the_flag_and_the_problem(text, problem):
    with pytest.raises(ValueError, match="--interactive-cpus: ") as err:
        parse_cpus(text, "--interactive-cpus", allowed={0, 1, 2, 3})
    assert problem in str(err.value)


def a_round(directs: dict[int, float], batch_tps: float, idle_p90: float, p90: float) -> dict:
    runs = [
        {"concurrency_per_replica": c, "tokens_per_s": t, "engine_cpu_util": 0.5}
        for c, t in directs.items()
    ]
    return {
        "directs": runs,
        "direct": max(runs, key=lambda r: r["tokens_per_s"]),
        "idle_ttft": {"p50_ms": idle_p90 / 2, "p90_ms": idle_p90},
        "idle_phase": {"interactive_engine_ttft_mean_ms": 10.0},
        "batches": [
            {
                "tokens_per_s": batch_tps,
                "ttft": {"p50_ms": p90 / 2, "p90_ms": p90},
                "interactive_engine_ttft_mean_ms": 11.0,
                "gateway_cpu_s": 1.0,
                "engine_cpu_util": 0.5,
                "interactive_engine_cpu_util": 0.1,
                "bound_per_replica": [100, 300],
                "request_counts": {"completed": 10, "failed": 0, "total": 10},
            }
        ],
    }


def test_the_maximum_is_the_best_setting_by_its_median_over_rounds_not_each_rounds_best():
    # Which setting wins flips between rounds (noise): each round's best would be 100 and 100
    # (median 100); by setting, 256 has a median of 95 and 384 of 85.
    rounds = [
        a_round({256: 100, 384: 80}, 90, idle_p90=40, p90=44),
        a_round({256: 90, 384: 100}, 95, idle_p90=50, p90=50),
        a_round({256: 95, 384: 85}, 94, idle_p90=45, p90=60),
    ]
    median = summarize_rounds(rounds, ["adaptive"])
    assert median["direct_by_setting"] == {256: 95, 384: 85}
    assert median["direct_best_setting"] == 256 and median["direct_tokens_per_s"] == 95
    assert median["direct_round_best_median"] == 100
    batch = median["batches"][0]
    assert batch["batch_tokens_per_s"] == 94 and batch["share_of_direct"] == pytest.approx(94 / 95)
    assert batch["share_of_round_best_each"] == pytest.approx([0.9, 0.95, 94 / 95])
    assert batch["ttft_p90_ms"] == 50 and median["idle_ttft_p90_ms"] == 45
    assert batch["ttft_p90_vs_idle"] == pytest.approx(50 / 45 - 1)
    assert batch["ttft_p90_vs_idle_each"] == pytest.approx([0.1, 0.0, 60 / 45 - 1])
    assert batch["interactive_engine_ttft_mean_ms"] == 11.0
    assert median["idle_interactive_engine_ttft_mean_ms"] == 10.0
    assert batch["completed"] == [10, 10, 10]


def test_direct_runs_before_and_after_the_batch_average_per_setting_in_their_round():
    round_ = a_round({256: 100, 384: 90}, 90, idle_p90=40, p90=44)
    round_["directs"] += [
        {"concurrency_per_replica": 384, "tokens_per_s": 70, "engine_cpu_util": 0.5},
        {"concurrency_per_replica": 256, "tokens_per_s": 80, "engine_cpu_util": 0.5},
    ]
    assert round_directs(round_) == {256: 90, 384: 80}
    median = summarize_rounds([round_], ["adaptive"])
    assert median["direct_tokens_per_s"] == 90 and median["batches"][0]["share_of_direct"] == 1


def test_rounds_of_separate_invocations_combine_only_for_the_same_workload(tmp_path: Path):
    args = {"engine": "sim", "requests": 10_000, "replicas": 4, "batch_concurrency": ["adaptive"]}
    first, second, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"args": args, "rounds": [a_round({256: 1}, 1, 1, 1)]}))
    second.write_text(json.dumps({"args": args, "rounds": [a_round({256: 2}, 2, 2, 2)]}))
    other.write_text(json.dumps({"args": {**args, "requests": 2000}, "rounds": []}))
    combined_args, rounds = combine([first, second])
    assert combined_args == args
    assert [r["direct"]["tokens_per_s"] for r in rounds] == [1, 2]
    with pytest.raises(ValueError, match=r"c\.json: requests is 2000, not 10000 as in .*a\.json"):
        combine([first, other])


def test_each_phase_sends_other_documents_under_the_same_family_prefixes():
    # The same requests again would hit whole prompts in the engines' prefix cache.
    args = argparse.Namespace(requests=16, families=8, prefix_words=50, doc_words=10, max_tokens=8)
    first, second = requests_of(args, 1), requests_of(args, 2)
    assert requests_of(args, 1) == first
    assert [r["messages"][0] for r in first] == [r["messages"][0] for r in second]
    assert len({r["messages"][0]["content"] for r in first}) == 8
    documents = [r["messages"][1]["content"] for r in first + second]
    assert len(set(documents)) == 32


def test_runners_side_by_side_each_with_every_batch_concurrency_and_named_in_the_medians():
    assert batch_settings(["gateway", "process"], ["adaptive", "64"]) == [
        ("gateway", "adaptive"), ("gateway", "64"), ("process", "adaptive"), ("process", "64")
    ]  # fmt: skip
    round_ = a_round({256: 100}, 90, idle_p90=40, p90=60)
    in_process = {**round_["batches"][0], "runner": "process", "runner_cpu_s": 2.0}
    in_process["ttft"] = {"p50_ms": 20, "p90_ms": 44}
    round_["batches"].append(in_process)
    median = summarize_rounds([round_], ["adaptive", "adaptive"])
    # A round from before the runner process had no "runner": the gateway ran the batch.
    assert [(b["runner"], b["runner_cpu_s"]) for b in median["batches"]] == [
        ("gateway", 0.0),
        ("process", 2.0),
    ]
    assert [b["ttft_p90_vs_idle"] for b in median["batches"]] == pytest.approx([0.5, 0.1])


@pytest.mark.parametrize(
    ("line", "first_token"),
    [
        (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n', False),
        (b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}\n', True),
        # The end-of-sequence token sampled first: no content, but a token was generated.
        (b'data: {"choices":[{"delta":{"content":""},"finish_reason":"stop"}]}\n', True),
        (b'data: {"choices":[],"usage":{"completion_tokens":1}}\n', False),
        (b"data: [DONE]\n", False),
        (b"\n", False),
    ],
)
def test_a_probe_times_its_first_token_even_when_it_ends_the_stream(line, first_token):
    assert has_content(line) is first_token
