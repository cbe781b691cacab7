"""Eval suites as data: loading, the example suite, and errors that name file:line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcserve.onboarding.suite import Custom, Exact, Params, SuiteError, load_suite, parse_suite

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "evals" / "bill-of-lading.jsonl"
HEADER = {"suite": "s", "key_metrics": ["ok"], "params": {"temperature": 0, "max_tokens": 16}}
CASE = {
    "id": "c1",
    "messages": [{"role": "user", "content": "hi"}],
    "expect": [{"metric": "ok", "scorer": "contains", "value": "hello"}],
}


def jsonl(*objs: object) -> bytes:
    return "\n".join(json.dumps(o) for o in objs).encode() + b"\n"


def test_the_example_bill_of_lading_suite_loads() -> None:
    suite = load_suite(EXAMPLE)
    assert suite.name == "bill-of-lading-extraction"
    assert len(suite.cases) >= 4
    assert set(suite.key_metrics) <= set(suite.metrics)
    assert {"json_valid", "json_schema", "fields"} <= set(suite.metrics)
    # every scorer kind but custom is used by the example
    kinds = {type(c).__name__ for case in suite.cases for c in case.expect}
    assert {"JsonValid", "JsonSchema", "Exact", "Numeric", "Regex", "Contains"} <= kinds


def test_a_suite_loads_with_params_merged_over_the_header() -> None:
    case = {**CASE, "params": {"max_tokens": 64, "seed": 7}}
    suite = parse_suite(jsonl(HEADER, case), source="s.jsonl")
    assert suite.key_metrics == ("ok",)
    assert suite.lines == (2,)
    (only,) = suite.cases
    assert suite.case_params(only) == Params(temperature=0, max_tokens=64, seed=7)
    assert suite.case_params(only).kwargs() == {"temperature": 0, "max_tokens": 64, "seed": 7}
    assert isinstance(only.expect[0], type(only.expect[0]))
    assert len(suite.digest) == 64


def test_a_prompt_case_and_a_custom_scorer() -> None:
    case = {
        "id": "p1",
        "prompt": "The capital of France is",
        "expect": [
            {"metric": "ok", "scorer": "exact", "value": "Paris"},
            {"metric": "site", "scorer": "custom", "function": "json:dumps"},
        ],
    }
    suite = parse_suite(jsonl(HEADER, case))
    assert isinstance(suite.cases[0].expect[0], Exact)
    assert isinstance(suite.cases[0].expect[1], Custom)
    assert suite.custom["json:dumps"] is json.dumps
    assert suite.metrics == ("ok", "site")


BAD_CASES = [
    # (the case line, what the error says)
    ({**CASE, "expect": []}, "s.jsonl:2: expect: expected array of length >= 1"),
    (
        {**CASE, "expect": [{"metric": "ok", "scorer": "fuzzy"}]},
        "s.jsonl:2: expect[0].scorer: invalid value 'fuzzy'; scorers: exact, contains",
    ),
    (
        {**CASE, "expect": [{"metric": "ok", "scorer": "exact"}]},
        "s.jsonl:2: expect[0]: object missing required field value",
    ),
    (
        {**CASE, "expect": [{"metric": "ok", "scorer": "regex", "pattern": "(["}]},
        "s.jsonl:2: expect[0].pattern: '([' is not a regex",
    ),
    (
        {**CASE, "expect": [{"metric": "ok", "scorer": "json_schema", "schema": {"type": 5}}]},
        "s.jsonl:2: expect[0].schema: not a valid JSON Schema at type",
    ),
    (
        {**CASE, "expect": [{"metric": "ok", "scorer": "numeric", "value": 1, "pattern": r"\d+"}]},
        "s.jsonl:2: expect[0].pattern: '\\\\d+' needs a group around the number",
    ),
    (
        {**CASE, "expect": [{"metric": "ok", "scorer": "custom", "function": "nosuchmod:f"}]},
        "s.jsonl:2: expect[0].function: cannot import 'nosuchmod'",
    ),
    (
        {**CASE, "expect": [{"metric": "ok", "scorer": "custom", "function": "json"}]},
        "s.jsonl:2: expect[0].function: 'json' is not of the form module:function",
    ),
    (
        {**CASE, "params": {"temperature": -1}},
        "s.jsonl:2: params.temperature: expected float >= 0.0, got -1",
    ),
    (
        {**CASE, "params": {"best_of": 3}},
        "s.jsonl:2: params: object contains unknown field best_of",
    ),
    ({**CASE, "prompt": "also"}, "s.jsonl:2: messages: give exactly one of messages (chat) and"),
    (
        {**CASE, "messages": [{"role": "robot", "content": "x"}]},
        "s.jsonl:2: messages[0].role: invalid enum value 'robot'",
    ),
    ({**CASE, "id": ""}, "s.jsonl:2: id: expected str matching regex"),
    ({**CASE, "colour": "red"}, "s.jsonl:2: (top level): object contains unknown field colour"),
]


@pytest.mark.parametrize(("case", "message"), BAD_CASES)
def test_a_bad_case_is_named_by_file_line_and_field(case: dict, message: str) -> None:
    with pytest.raises(SuiteError) as err:
        parse_suite(jsonl(HEADER, case), source="s.jsonl")
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (b"", "s.jsonl: empty suite"),
        (jsonl(CASE), "s.jsonl:1: the first line must be the suite header"),
        (jsonl(HEADER), "s.jsonl: the suite has no cases"),
        (jsonl({**HEADER, "key_metrics": []}, CASE), "s.jsonl:1: key_metrics: expected array"),
        (
            jsonl({**HEADER, "key_metrics": ["missing"]}, CASE),
            "s.jsonl:1: key_metrics: 'missing' is scored by no check (metrics: ok)",
        ),
        (
            jsonl({**HEADER, "min_scores": {"ok": 101}}, CASE),
            "s.jsonl:1: min_scores[...]: expected float <= 100.0",
        ),
        (jsonl(HEADER, CASE, CASE), "s.jsonl:3: id: 'c1' is used by line 2 already"),
        (jsonl(HEADER) + b"{not json\n" + jsonl(CASE), "s.jsonl:2: not a JSON object"),
        (jsonl(HEADER, [1, 2]), "s.jsonl:2: not a JSON object (got list)"),
        (b"\xff\xfe", "s.jsonl: not UTF-8 text"),
    ],
)
def test_a_bad_suite_says_where(lines: bytes, message: str) -> None:
    with pytest.raises(SuiteError) as err:
        parse_suite(lines, source="s.jsonl")
    assert message in str(err.value), str(err.value)


def test_every_problem_is_reported_at_once() -> None:
    bad = [{**CASE, "id": f"c{i}", "params": {"top_p": 2}} for i in range(3)]
    with pytest.raises(SuiteError) as err:
        parse_suite(jsonl(HEADER, *bad), source="s.jsonl")
    assert [p.split(":")[1] for p in err.value.problems] == ["2", "3", "4"]


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match="cannot read the suite"):
        load_suite(tmp_path / "absent.jsonl")
