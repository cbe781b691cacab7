"""Each scorer of an eval suite, as a table: check, answer -> score."""

from __future__ import annotations

import json

import pytest

from hpcserve.onboarding.scorers import ScorerError, answer_json, field_value, metric_points, score
from hpcserve.onboarding.suite import (
    Case,
    Check,
    Contains,
    Custom,
    Exact,
    JsonSchema,
    JsonValid,
    Message,
    Numeric,
    Regex,
    resolve_function,
)

BOL = json.dumps(
    {
        "bol_number": "HLCU-HAM-2401",
        "shipper": {"name": "ACME Tools GmbH"},
        "gross_weight_kg": 18250.5,
        "containers": [{"number": "MSKU1234565"}],
        "hazardous": False,
    }
)
FENCED = f"```json\n{BOL}\n```"
CASE = Case(id="c1", messages=[Message("user", "extract")], expect=[JsonValid(metric="m")])
SCHEMA = {
    "type": "object",
    "required": ["bol_number", "gross_weight_kg"],
    "properties": {"bol_number": {"type": "string"}, "gross_weight_kg": {"type": "number"}},
}


def share_of_words(answer: str, case: Case, *, words: list[str]) -> float:
    """A site metric: the share of `words` that appear in the answer."""
    return sum(w in answer for w in words) / len(words)


def broken(answer: str, case: Case) -> float:
    return 7.0


@pytest.mark.parametrize(
    ("check", "answer", "expected"),
    [
        # exact: the whole text (stripped), or a field's JSON value
        (Exact(metric="m", value="Paris"), "  Paris\n", 1.0),
        (Exact(metric="m", value="Paris"), "paris", 0.0),
        (Exact(metric="m", value="Paris", ignore_case=True), "paris", 1.0),
        (Exact(metric="m", field="shipper.name", value="ACME Tools GmbH"), BOL, 1.0),
        (Exact(metric="m", field="gross_weight_kg", value=18250.5), BOL, 1.0),
        (Exact(metric="m", field="hazardous", value=False), BOL, 1.0),
        (Exact(metric="m", field="hazardous", value=0), BOL, 0.0),  # a bool is no number
        (Exact(metric="m", field="containers.0.number", value="MSKU1234565"), FENCED, 1.0),
        (Exact(metric="m", field="consignee.name", value="x"), BOL, 0.0),  # missing field
        (Exact(metric="m", field="shipper.name", value="x"), "not json", 0.0),
        # contains
        (Contains(metric="m", value="lading"), "Bill of lading no. 7", 1.0),
        (Contains(metric="m", value="LADING"), "Bill of lading", 0.0),
        (Contains(metric="m", value="LADING", ignore_case=True), "Bill of lading", 1.0),
        (Contains(metric="m", field="shipper", value="ACME"), BOL, 1.0),  # a dict as JSON text
        # regex: re.search
        (Regex(metric="m", pattern=r"^[A-Z]{4}\d{7}$", field="containers.0.number"), BOL, 1.0),
        (Regex(metric="m", pattern=r"\d{4}-\d{2}-\d{2}"), "shipped on 2024-03-01", 1.0),
        (Regex(metric="m", pattern=r"\d{4}-\d{2}-\d{2}"), "shipped in March", 0.0),
        # json_valid: the text, or one fenced block
        (JsonValid(metric="m"), BOL, 1.0),
        (JsonValid(metric="m"), FENCED, 1.0),
        (JsonValid(metric="m"), BOL[:-1], 0.0),
        (JsonValid(metric="m"), "Here it is: " + BOL, 0.0),
        # json_schema
        (JsonSchema(metric="m", schema=SCHEMA), BOL, 1.0),
        (JsonSchema(metric="m", schema=SCHEMA), json.dumps({"bol_number": "x"}), 0.0),
        (JsonSchema(metric="m", schema=SCHEMA), "{bad", 0.0),
        (JsonSchema(metric="m", field="shipper", schema={"required": ["name"]}), BOL, 1.0),
        # numeric: a field, a regex group or the first number, within a tolerance
        (Numeric(metric="m", field="gross_weight_kg", value=18250.0, tolerance=1), BOL, 1.0),
        (Numeric(metric="m", field="gross_weight_kg", value=18000.0, tolerance=1), BOL, 0.0),
        (Numeric(metric="m", field="gross_weight_kg", value=18000.0, relative=0.02), BOL, 1.0),
        (Numeric(metric="m", field="bol_number", value=2401), BOL, 0.0),  # "HLCU-HAM-2401"
        (Numeric(metric="m", value=42), "The answer is 42.", 1.0),
        (Numeric(metric="m", value=1250), "weight: 1,250 kg", 1.0),
        (Numeric(metric="m", value=3, pattern=r"(\d+) containers"), "7 days, 3 containers", 1.0),
        (Numeric(metric="m", value=3, pattern=r"(\d+) containers"), "no count", 0.0),
        (Numeric(metric="m", value=1), "none", 0.0),
        (Numeric(metric="m", field="hazardous", value=0), BOL, 0.0),
        # custom: module:function(answer or field, case, **args)
        (
            Custom(metric="m", function=f"{__name__}:share_of_words", args={"words": ["a", "z"]}),
            "a b c",
            0.5,
        ),
        (
            Custom(
                metric="m",
                field="shipper.name",
                function=f"{__name__}:share_of_words",
                args={"words": ["ACME"]},
            ),
            BOL,
            1.0,
        ),
    ],
)
def test_scorer(check: Check, answer: str, expected: float) -> None:
    custom = {}
    if isinstance(check, Custom):
        custom[check.function] = resolve_function(check.function)
    assert score(check, answer, CASE, custom) == expected


def test_a_custom_scorer_out_of_range_is_its_error_not_a_score() -> None:
    check = Custom(metric="m", function=f"{__name__}:broken")
    with pytest.raises(ScorerError, match=r"returned 7.0, not a score in \[0, 1\]"):
        score(check, "x", CASE, {check.function: broken})


@pytest.mark.parametrize(
    ("text", "path", "expected"),
    [
        (BOL, "containers.0.number", "MSKU1234565"),
        (FENCED, "shipper.name", "ACME Tools GmbH"),
        ("```\n[1, 2]\n```", "1", 2),
    ],
)
def test_fields_are_read_from_the_answer_as_json(text: str, path: str, expected: object) -> None:
    assert field_value(answer_json(text), path) == expected


def test_metric_points_are_the_mean_of_their_checks_in_points() -> None:
    scored = [("fields", 1.0), ("fields", 0.0), ("fields", 1.0), ("json_valid", 1.0)]
    assert metric_points(scored) == {"fields": 66.67, "json_valid": 100.0}
