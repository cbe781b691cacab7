"""An eval suite as data: a JSONL file of cases, validated once at load.

The first line is the suite's header, every other non-blank line one case:

    {"suite": "bol-extraction", "key_metrics": ["json_valid", "fields"],
     "params": {"temperature": 0, "max_tokens": 256}, "min_scores": {"json_valid": 90}}
    {"id": "bol-001", "messages": [{"role": "user", "content": "..."}],
     "params": {"response_format": {"type": "json_object"}},
     "expect": [{"metric": "json_valid", "scorer": "json_valid"},
                {"metric": "fields", "scorer": "exact", "field": "shipper.name", "value": "ACME"}]}

A case has `messages` (chat) or `prompt` (completions), sampling `params` over the header's,
and `expect`: checks, each scored 0..1 by a scorer (scorers.py) and counted towards its
named metric. A metric's score is the mean of its checks over all cases, in points (0-100);
`key_metrics` are the ones the parity gate compares (gate.py). `min_scores` are absolute
floors (the gate of a version without a baseline). Scorers: exact, contains, regex,
json_valid, json_schema, numeric (a number from a JSON field or a regex group, within a
tolerance) and custom (`module:function`, a site's own metric).

Every problem is reported at once, each as `FILE:LINE: FIELD: what is wrong`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import msgspec

from hpcserve.config import humanize_validation_error

MetricName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
CaseId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")]
Points = Annotated[float, msgspec.Meta(ge=0, le=100)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
MAX_ERRORS_SHOWN = 20

# A custom scorer: (answer text, the case, **args from the check) -> a score in [0, 1]
# (a bool counts as 0 or 1).
CustomScorer = Callable[..., float | bool]


class SuiteError(ValueError):
    """A suite that does not load; `problems` holds every `FILE:LINE: FIELD: ...` line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:MAX_ERRORS_SHOWN]
        more = len(problems) - len(shown)
        super().__init__("\n".join(shown + ([f"(and {more} more)"] if more > 0 else [])))


class Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    role: Literal["system", "user", "assistant"]
    content: str


class Params(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """Sampling parameters, as the OpenAI API takes them; `extra_body` carries vLLM's own
    (top_k, structured_outputs, ...)."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    max_tokens: PosInt | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    extra_body: dict[str, Any] | None = None

    def over(self, base: Params) -> Params:
        """These parameters, with `base`'s where these leave one unset."""
        mine = msgspec.structs.asdict(self)
        theirs = msgspec.structs.asdict(base)
        return Params(**{k: mine[k] if mine[k] is not None else theirs[k] for k in mine})

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class _Check(
    msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag_field="scorer"
):
    metric: MetricName
    # A field of the answer read as JSON ("shipper.name", "containers.0.number"); "": the
    # answer's whole text.
    field: str = ""


JsonScalar = str | int | float | bool | None


class Exact(_Check, tag="exact", frozen=True):
    value: JsonScalar
    ignore_case: bool = False


class Contains(_Check, tag="contains", frozen=True):
    value: str
    ignore_case: bool = False


class Regex(_Check, tag="regex", frozen=True):
    pattern: str  # re.search over the text (or the field's value)


class JsonValid(_Check, tag="json_valid", frozen=True):
    pass


class JsonSchema(_Check, tag="json_schema", frozen=True):
    schema: dict[str, Any]


class Numeric(_Check, tag="numeric", frozen=True):
    """A number within `tolerance` (absolute) or `relative` (a share of `value`) of it: from
    `field`, else the first group of `pattern`, else the first number in the text."""

    value: float
    tolerance: NonNegFloat = 0.0
    relative: NonNegFloat = 0.0
    pattern: str = ""


class Custom(_Check, tag="custom", frozen=True):
    function: str  # "package.module:function"
    args: dict[str, Any] = {}


Check = Exact | Contains | Regex | JsonValid | JsonSchema | Numeric | Custom
SCORERS = ("exact", "contains", "regex", "json_valid", "json_schema", "numeric", "custom")


class Case(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    id: CaseId
    messages: list[Message] | None = None
    prompt: str | None = None
    params: Params = Params()
    expect: Annotated[list[Check], msgspec.Meta(min_length=1)]


class Header(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    suite: MetricName
    key_metrics: Annotated[list[MetricName], msgspec.Meta(min_length=1)]
    description: str = ""
    params: Params = Params()
    min_scores: dict[MetricName, Points] = {}


@dataclass(frozen=True)
class Suite:
    name: str
    path: str
    digest: str  # sha256 of the file: which suite, exactly, a score came from
    key_metrics: tuple[str, ...]
    cases: tuple[Case, ...]
    lines: tuple[int, ...]  # the file line of each case
    metrics: tuple[str, ...]  # every metric, in the order first used
    params: Params = field(default_factory=Params)
    min_scores: dict[str, float] = field(default_factory=dict)
    description: str = ""
    custom: dict[str, CustomScorer] = field(default_factory=dict)  # "mod:fn" -> function

    def case_params(self, case: Case) -> Params:
        return case.params.over(self.params)


def load_suite(path: str | Path) -> Suite:
    """Read and check a suite file; raises SuiteError listing every problem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SuiteError([f"{path}: cannot read the suite: {err.strerror}"]) from None
    return parse_suite(raw, source=str(path))


def parse_suite(raw: bytes, *, source: str = "suite") -> Suite:
    problems: list[str] = []
    header: Header | None = None
    cases: list[Case] = []
    lines: list[int] = []
    first, header_ok = True, False
    try:
        text = raw.decode()
    except UnicodeDecodeError as err:
        raise SuiteError([f"{source}: not UTF-8 text ({err.reason} at byte {err.start})"]) from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            data = json.loads(line)
        except ValueError as err:
            problems.append(f"{where}: not a JSON object: {err}")
            continue
        if not isinstance(data, dict):
            problems.append(f"{where}: not a JSON object (got {type(data).__name__})")
            continue
        kind: type[Header] | type[Case] = Header if first else Case
        if first:
            first = False
            # A bad header is reported and the cases still checked.
            header = Header(suite="invalid", key_metrics=[])
            if "suite" not in data:
                problems.append(
                    f'{where}: the first line must be the suite header ({{"suite": ...}})'
                )
                kind = Case
        try:
            item = msgspec.convert(data, kind)
        except msgspec.ValidationError as err:
            message = humanize_validation_error(err, data)
            if "scorer: invalid value" in message or "missing required field scorer" in message:
                message += f"; scorers: {', '.join(SCORERS)}"
            problems.append(f"{where}: {message}")
            continue
        if isinstance(item, Header):
            header = item
            header_ok = True
        else:
            problems += _check_case(item, where)
            cases.append(item)
            lines.append(number)
    if header is None:
        raise SuiteError(problems or [f"{source}: empty suite (no header, no cases)"])
    if not header_ok:
        raise SuiteError(problems)
    if not cases and not problems:
        problems.append(f"{source}: the suite has no cases")
    metrics = list(dict.fromkeys(c.metric for case in cases for c in case.expect))
    header_line = _first_line(text)
    for name in header.key_metrics:
        if cases and name not in metrics:
            problems.append(
                f"{source}:{header_line}: key_metrics: {name!r} is scored by no check "
                f"(metrics: {', '.join(metrics) or 'none'})"
            )
    for name in header.min_scores:
        if cases and name not in metrics:
            problems.append(f"{source}:{header_line}: min_scores: {name!r} is scored by no check")
    seen: dict[str, int] = {}
    for case, number in zip(cases, lines, strict=True):
        if case.id in seen:
            problems.append(
                f"{source}:{number}: id: {case.id!r} is used by line {seen[case.id]} already"
            )
        seen.setdefault(case.id, number)
    custom: dict[str, CustomScorer] = {}
    for case, number in zip(cases, lines, strict=True):
        for i, check in enumerate(case.expect):
            if isinstance(check, Custom) and check.function not in custom:
                try:
                    custom[check.function] = resolve_function(check.function)
                except ValueError as err:
                    problems.append(f"{source}:{number}: expect[{i}].function: {err}")
    if problems:
        raise SuiteError(problems)
    return Suite(
        name=header.suite,
        path=source,
        digest=hashlib.sha256(raw).hexdigest(),
        key_metrics=tuple(header.key_metrics),
        cases=tuple(cases),
        lines=tuple(lines),
        metrics=tuple(metrics),
        params=header.params,
        min_scores=dict(header.min_scores),
        description=header.description,
        custom=custom,
    )


def _first_line(text: str) -> int:
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            return number
    return 1


def _check_case(case: Case, where: str) -> list[str]:
    problems = []
    if (case.messages is None) == (case.prompt is None):
        problems.append(f"{where}: messages: give exactly one of messages (chat) and prompt")
    elif case.messages is not None and not case.messages:
        problems.append(f"{where}: messages: empty; give at least one message")
    for i, check in enumerate(case.expect):
        at = f"{where}: expect[{i}]"
        if check.field and not all(check.field.split(".")):
            problems.append(f"{at}.field: {check.field!r} has an empty part")
        for name in ("pattern",):
            pattern = getattr(check, name, "")
            if pattern:
                try:
                    re.compile(pattern)
                except re.error as err:
                    problems.append(f"{at}.{name}: {pattern!r} is not a regex: {err}")
        if isinstance(check, Regex) and not check.pattern:
            problems.append(f"{at}.pattern: empty (it would match anything)")
        if isinstance(check, JsonSchema):
            try:
                jsonschema.validators.validator_for(check.schema).check_schema(check.schema)
            except jsonschema.SchemaError as err:
                path = "/".join(str(x) for x in err.absolute_path) or "(root)"
                problems.append(f"{at}.schema: not a valid JSON Schema at {path}: {err.message}")
        if isinstance(check, Numeric) and check.pattern and re.compile(check.pattern).groups < 1:
            problems.append(f"{at}.pattern: {check.pattern!r} needs a group around the number")
    return problems


def resolve_function(spec: str) -> CustomScorer:
    """`package.module:function` -> the function; ValueError says what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a site's module may fail in any way at import
        raise ValueError(f"cannot import {module_name!r}: {err}") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"{module_name!r} has no {attr!r}")
    if not callable(target):
        raise ValueError(f"{spec!r} is not callable")
    return target
