"""The workload generator (bench/workload.py) and the suite's doc writer (bench/suite.py)."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from bench.suite import BENCHMARKS, in_suite_order, markdown_table, update_doc
from bench.workload import (
    SLO,
    Lengths,
    RequestResult,
    build,
    bursty,
    poisson,
    summarize,
)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_and_bursty_arrivals_keep_the_mean_rate_and_differ_in_spread() -> None:
    p = gaps(poisson(50.0, 4000, random.Random(1)))
    b = gaps(bursty(50.0, 4000, random.Random(1), cv=3.0))
    assert statistics.mean(p) == pytest.approx(1 / 50, rel=0.1)
    assert statistics.mean(b) == pytest.approx(1 / 50, rel=0.25)
    assert statistics.stdev(p) / statistics.mean(p) == pytest.approx(1.0, rel=0.15)
    assert statistics.stdev(b) / statistics.mean(b) > 2.0


def test_lengths_are_clipped_and_unknown_kinds_refused() -> None:
    rng = random.Random(0)
    draws = [Lengths("lognormal", mean=64, low=4, high=100).draw(rng) for _ in range(500)]
    assert min(draws) >= 4 and max(draws) <= 100
    assert 40 < statistics.median(draws) < 80
    with pytest.raises(ValueError, match="allowed: fixed, uniform, lognormal"):
        Lengths("zipf").draw(rng)


def test_doc_extraction_shares_a_long_prefix_per_customer() -> None:
    specs = build("doc-extraction", model="m", requests=60, customers=4, document_tokens=3000)
    by_customer: dict[str, set[str]] = {}
    for spec in specs:
        by_customer.setdefault(spec.group, set()).add(spec.messages[0]["content"])
    assert all(len(prefixes) == 1 for prefixes in by_customer.values())
    (doc,) = by_customer[specs[0].group]
    assert 2900 <= len(doc.split()) <= 3010  # words counted as tokens here
    assert len({s.messages[1]["content"] for s in specs}) > 50  # queries differ
    assert [s.at_s for s in specs] == sorted(s.at_s for s in specs)


def test_multi_turn_extends_each_session_turn_by_turn() -> None:
    specs = build("multi-turn", model="m", requests=24, sessions=4, turns=6, rate=5.0)
    assert len(specs) == 24
    for session in {s.group for s in specs}:
        turns = [s for s in specs if s.group == session]
        for earlier, later in itertools.pairwise(turns):
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert later.at_s >= earlier.at_s


def test_system_prompt_and_random_workloads_and_bad_names() -> None:
    shared = build("system-prompt", model="m", requests=10, system_tokens=200)
    assert len({s.messages[0]["content"] for s in shared}) == 1
    rand = build("random", model="m", requests=10)
    assert len({s.messages[0]["content"] for s in rand}) == 10
    with pytest.raises(ValueError, match="known: doc-extraction"):
        build("chatty", model="m")
    with pytest.raises(ValueError, match="unknown workload parameter"):
        build("random", model="m", colour="red")


def test_goodput_counts_requests_within_both_slos() -> None:
    results = [
        RequestResult(0.0, "", 200, ttft_s=0.1, tpot_s=0.01, e2e_s=1.0, prompt_tokens=100,
                      cached_tokens=50, completion_tokens=10),
        RequestResult(0.5, "", 200, ttft_s=2.0, tpot_s=0.01, e2e_s=3.0, prompt_tokens=100,
                      completion_tokens=10),
        RequestResult(1.0, "", 503, error="no replica"),
    ]  # fmt: skip
    summary = summarize(results, SLO(ttft_s=1.0, tpot_s=0.05))
    assert (summary.requests, summary.ok) == (3, 2)
    assert summary.goodput == pytest.approx(1 / 3)
    assert summary.cached_share == pytest.approx(0.25)
    assert summary.duration_s == pytest.approx(3.5)


def test_the_suite_rewrites_only_its_own_block() -> None:
    doc = "# Benchmarks\n\nprose\n"
    once = update_doc(doc, "a", "<!-- suite:a -->\nA1\n<!-- /suite:a -->")
    twice = update_doc(once, "b", "<!-- suite:b -->\nB1\n<!-- /suite:b -->")
    again = update_doc(twice, "a", "<!-- suite:a -->\nA2\n<!-- /suite:a -->")
    assert again.startswith("# Benchmarks\n\nprose\n")
    assert "A2" in again and "A1" not in again and "B1" in again
    assert again.count("## Suite run") == 1
    assert markdown_table([{"x": 1, "y": 0.123456}, {"x": 2, "z": "s"}]).splitlines() == [
        "| x | y | z |",
        "|---|---|---|",
        "| 1 | 0.1235 |  |",
        "| 2 |  | s |",
    ]


def test_the_suite_keeps_its_blocks_in_registration_order() -> None:
    first, second = BENCHMARKS[0].name, BENCHMARKS[1].name
    doc = update_doc("# B\n", second, f"<!-- suite:{second} -->\n2\n<!-- /suite:{second} -->")
    doc = update_doc(doc, first, f"<!-- suite:{first} -->\n1\n<!-- /suite:{first} -->")
    ordered = in_suite_order(doc)
    assert ordered.index(f"suite:{first} ") < ordered.index(f"suite:{second} ")
    assert (
        in_suite_order(doc + "\n## Written below the suite\n")
        == doc + "\n## Written below the suite\n"
    )
