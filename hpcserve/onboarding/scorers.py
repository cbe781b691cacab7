"""Scorers: one check of a suite (suite.py) against one answer -> a score in [0, 1].

An answer "as JSON" is its text stripped, or the inside of one Markdown code fence around
it (```json ... ```), since models often fence JSON they were asked for. A `field` is a
dotted path into that JSON (`shipper.name`, `containers.0.number`); a check whose field is
missing, or whose answer is no JSON, scores 0. Metric scores are the mean of their checks
in points (0-100), so "1 point" is one percent of the checks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jsonschema

from hpcserve.onboarding.suite import (
    Case,
    Check,
    Contains,
    Custom,
    CustomScorer,
    Exact,
    JsonSchema,
    JsonValid,
    Numeric,
    Regex,
)

_FENCE = re.compile(r"^```[A-Za-z0-9_-]*[ \t]*\n(?P<body>.*?)\n?```$", re.DOTALL)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:[.,]\d+)*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


class NoValue(Exception):
    """The answer has no value where the check looks (no JSON, no such field, no number)."""


class ScorerError(Exception):
    """A custom scorer that failed or returned something other than a score."""


def answer_json(text: str) -> Any:
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group("body").strip()
    try:
        return json.loads(body)
    except ValueError:
        raise NoValue("the answer is not JSON") from None


def field_value(doc: Any, path: str) -> Any:
    """The value at a dotted path ("a.b.0.c"); NoValue when a step is missing."""
    for step in path.split("."):
        if isinstance(doc, dict) and step in doc:
            doc = doc[step]
        elif isinstance(doc, list) and step.isdigit() and int(step) < len(doc):
            doc = doc[int(step)]
        else:
            raise NoValue(f"no field {path!r} in the answer")
    return doc


def _subject(check: Check, text: str) -> Any:
    """What the check looks at: the field's value, or the whole text."""
    if not check.field:
        return text
    return field_value(answer_json(text), check.field)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _to_number(value: Any) -> float:
    if isinstance(value, bool):
        raise NoValue(f"{value!r} is not a number")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        found = _NUMBER.search(value)
        if found:
            return float(found.group().replace(",", ""))
    raise NoValue(f"{value!r} is not a number")


def score(check: Check, text: str, case: Case, custom: Mapping[str, CustomScorer]) -> float:
    """The check's score for answer `text`: 0 or 1, or a custom scorer's value in [0, 1]."""
    try:
        return _score(check, text, case, custom)
    except NoValue:
        return 0.0


def _score(check: Check, text: str, case: Case, custom: Mapping[str, CustomScorer]) -> float:
    if isinstance(check, JsonValid):
        _subject(check, text) if check.field else answer_json(text)
        return 1.0
    if isinstance(check, JsonSchema):
        doc = _subject(check, text) if check.field else answer_json(text)
        ok = jsonschema.validators.validator_for(check.schema)(check.schema).is_valid(doc)
        return float(ok)
    if isinstance(check, Exact):
        got = _subject(check, text)
        want = check.value
        if isinstance(got, str) and isinstance(want, str):
            got, want = got.strip(), want.strip()
            if check.ignore_case:
                got, want = got.casefold(), want.casefold()
        return float((got == want and type(got) is type(want)) or _same_number(got, want))
    if isinstance(check, Contains):
        got = _as_text(_subject(check, text))
        want = check.value
        if check.ignore_case:
            got, want = got.casefold(), want.casefold()
        return float(want in got)
    if isinstance(check, Regex):
        return float(re.search(check.pattern, _as_text(_subject(check, text))) is not None)
    if isinstance(check, Numeric):
        if check.field:
            got = _to_number(_subject(check, text))
        elif check.pattern:
            found = re.search(check.pattern, text)
            if found is None or found.group(1) is None:
                raise NoValue("the pattern does not match")
            got = _to_number(found.group(1))
        else:
            got = _to_number(text)
        allowed = max(check.tolerance, check.relative * abs(check.value))
        return float(math.isfinite(got) and abs(got - check.value) <= allowed + 1e-12)
    if isinstance(check, Custom):
        return _custom(check, text, case, custom)
    raise AssertionError(f"unknown check {check!r}")


def _same_number(got: Any, want: Any) -> bool:
    numbers = (int, float)
    return (
        isinstance(got, numbers)
        and isinstance(want, numbers)
        and not isinstance(got, bool)
        and not isinstance(want, bool)
        and got == want
    )


def _custom(check: Custom, text: str, case: Case, custom: Mapping[str, CustomScorer]) -> float:
    subject = _subject(check, text)
    try:
        value = custom[check.function](subject, case, **check.args)
    except NoValue:
        raise
    except Exception as err:  # the site's code: any failure is its scorer's, named
        raise ScorerError(f"{check.function} failed: {type(err).__name__}: {err}") from None
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ScorerError(f"{check.function} returned {value!r}, not a score in [0, 1]")
    return float(value)


def metric_points(scored: Iterable[tuple[str, float]]) -> dict[str, float]:
    """(metric, check score) pairs -> each metric's mean in points (0-100), 2 decimals."""
    sums: dict[str, list[float]] = {}
    for metric, value in scored:
        sums.setdefault(metric, []).append(value)
    return {m: round(100 * sum(v) / len(v), 2) for m, v in sums.items()}
