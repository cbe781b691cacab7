"""JSON schemas the gateway lets through are ones the engine's grammar backend compiles: each
crash class seen on vLLM 0.32.0 is refused with a 400 naming where, and for generated
schemas, whatever the gateway accepts xgrammar (the backend vLLM's engine core compiles
with, same version, same options) compiles too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcserve.gateway.errors import APIError
from hpcserve.gateway.schema_check import MAX_COUNT, check_regex
from hpcserve.gateway.validate import check_json_schema

PARAM = "response_format.json_schema.schema"


def refusal(schema: Any) -> APIError:
    with pytest.raises(APIError) as err:
        check_json_schema(schema, PARAM)
    assert err.value.status == 400 and err.value.param == PARAM
    return err.value


# Each a 500 (or a killed API server) from vLLM 0.32.0 in "auto" structured-output mode.
@pytest.mark.parametrize(
    ("schema", "where", "needle"),
    [
        ({"type": "object", "properties": {"a": {"enum": []}}}, ".properties.a.enum", "non-empty"),
        ({"type": "array", "prefixItems": [{"enum": []}]}, ".prefixItems[0].enum", "non-empty"),
        ({"type": "integer", "maximum": 2**70}, ".maximum", "64-bit"),
        ({"type": "integer", "maximum": 1e300}, ".maximum", "64-bit"),
        ({"type": "integer", "minimum": 1.5}, ".minimum", "whole number"),
        ({"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 6}, "", "no integer"),
        ({"type": "number", "minimum": 3, "maximum": 1}, "", "no number"),
        ({"$ref": "#"}, ".$ref", "leads back to itself"),
        ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, ".$ref", "itself"),
        ({"$ref": "#/nope"}, ".$ref", "points at nothing"),
        ({"$ref": "https://example.com/s.json"}, ".$ref", "only references within"),
        ({"type": "string", "pattern": "\\p{L}"}, ".pattern", "Unicode property"),
        ({"type": "string", "pattern": "a\u0000"}, ".pattern", "NUL"),
        ({"type": "string", "pattern": "(a)\\1"}, ".pattern", "backreference"),
        ({"type": "string", "pattern": "(?<=a)b"}, ".pattern", "lookbehind"),
        ({"type": "string", "pattern": "\\bword"}, ".pattern", "word boundary"),
        ({"type": "object", "patternProperties": {"(": {}}}, ".patternProperties", "regex"),
        ({"type": "array", "minItems": 10**9}, ".minItems", "limit"),
        ({"type": "array", "items": {}, "maxItems": MAX_COUNT + 1}, ".maxItems", "limit"),
        ({"type": "array", "minItems": 1}, ".minItems", "'items'"),
        ({"type": "object", "minProperties": 1}, ".minProperties", "additionalProperties"),
        ({"type": "object", "properties": {"a": False}}, ".properties.a", "`false`"),
        ({"type": "object", "propertyNames": False}, ".propertyNames", "`false`"),
        ({"type": "array", "items": [{}], "additionalItems": False}, ".additionalItems", "`false`"),
        (False, "", "`false`"),
        ({"type": "string", "minLength": 5, "maxLength": 1}, "", "greater than maxLength"),
    ],
)  # fmt: skip
def test_crash_classes_are_refused_naming_where(schema: Any, where: str, needle: str) -> None:
    err = refusal(schema)
    assert err.message.startswith(PARAM + where), err.message
    assert needle in err.message


def test_deep_schemas_are_refused_before_any_recursive_walk() -> None:
    schema: Any = {}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    assert "more than 64 levels" in refusal(schema).message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"enum": {"type": "string"}}, "required": ["enum"]},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        {"type": "array", "items": False, "prefixItems": [{}, {}], "minItems": 2},
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        {"type": "string", "pattern": "^(\\d{4})-\\d\\d$"},
        {"type": "string", "pattern": "a\\\\p"},  # an escaped backslash, then a plain p
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
         "$ref": "#/$defs/n"},  # recursion through a property: a linked list
        # OpenAI's strict mode (and openai.pydantic_function_tool) always says this:
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
         "additionalProperties": False},
        {"type": "object", "properties": {"a": {"type": "string"}},
         "unevaluatedProperties": False},
        {"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": False},
    ],
)  # fmt: skip
def test_ordinary_schemas_pass(schema: Any) -> None:
    check_json_schema(schema, PARAM)


def test_a_bad_regex_names_the_param() -> None:
    with pytest.raises(APIError) as err:
        check_regex("(", "structured_outputs.regex")
    assert (
        err.value.param == "structured_outputs.regex" and "not a valid regex" in err.value.message
    )


# Generated schemas: a pool of the constructs above, good and bad, nested.
_PATTERNS = ["^a+$", "\\d{2,4}", "[a-z]*", "(", "\\p{L}", "(a)\\1", "(?<=x)y", "\\bz", "a|b", ""]
_numbers = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([0.5, 1.5, -2.5, 1e300, 2**63, 2**63 - 1, -(2**63), 10**6]),
)
_counts = st.one_of(st.integers(0, 4), st.sampled_from([MAX_COUNT, MAX_COUNT + 1, 10**9]))


def _leaf() -> st.SearchStrategy[Any]:
    kinds = st.sampled_from(["string", "integer", "number", "boolean", "null", "array", "object"])
    return st.one_of(
        st.booleans(),
        st.fixed_dictionaries(
            {},
            optional={
                "type": kinds | st.lists(kinds, min_size=1, max_size=2, unique=True),
                "enum": st.lists(st.integers(0, 3) | st.text(max_size=2), max_size=2),
                "const": st.integers(0, 3),
                "minimum": _numbers,
                "maximum": _numbers,
                "exclusiveMinimum": _numbers,
                "exclusiveMaximum": _numbers,
                "minLength": _counts,
                "maxLength": _counts,
                "minItems": _counts,
                "maxItems": _counts,
                "minProperties": _counts,
                "maxProperties": _counts,
                "pattern": st.sampled_from(_PATTERNS),
                "format": st.sampled_from(["email", "date-time", "uuid"]),
                "$ref": st.sampled_from(["#", "#/$defs/d", "#/nope", "#/properties/a"]),
            },
        ),
    )


def _extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["object", "array"]),
            "properties": st.dictionaries(st.sampled_from(["a", "b", "enum"]), inner, max_size=2),
            "required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=2, unique=True),
            "additionalProperties": inner,
            "patternProperties": st.dictionaries(st.sampled_from(_PATTERNS), inner, max_size=1),
            "items": inner,
            "prefixItems": st.lists(inner, max_size=2),
            "anyOf": st.lists(inner, max_size=2),
            "oneOf": st.lists(inner, max_size=2),
            "allOf": st.lists(inner, max_size=2),
            "$defs": st.fixed_dictionaries({"d": inner}),
            "minItems": _counts,
            "minProperties": _counts,
        },
    )


schemas = st.recursive(_leaf(), _extend, max_leaves=8)


@pytest.fixture(scope="module")
def compiler() -> Iterator[Any]:
    import xgrammar as xgr  # vLLM's dependency; imported here: it takes seconds

    vocab = [chr(c) for c in range(32, 127)] + ['"a', '{"', '":', "true", "null", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    yield xgr.GrammarCompiler(info, max_threads=1)


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=schemas)
def test_whatever_the_gateway_accepts_xgrammar_compiles(compiler: Any, schema: Any) -> None:
    try:
        check_json_schema(schema, PARAM)
    except APIError:
        return
    # As vLLM's engine core: compile_json_schema(..., any_whitespace=True), strict mode.
    compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        ("root ::= ", "not an EBNF grammar the engine can parse: EBNF parser error"),
        ('root ::= "a" | b', "not an EBNF grammar"),
        ('start: "a" | b', "not a Lark grammar"),
        ("   ", "is empty"),
        ("x" * 100_001, "over the gateway's limit"),
    ],
)
def test_grammars_the_engine_cannot_parse_are_refused(grammar: str, needle: str) -> None:
    from hpcserve.gateway.schema_check import check_grammar

    with pytest.raises(APIError) as err:
        check_grammar(grammar, "structured_outputs.grammar")
    assert err.value.param == "structured_outputs.grammar"
    assert needle in err.value.message


@pytest.mark.parametrize(
    "grammar",
    ['root ::= "yes" | "no"', 'start: "a" "b"\n', '# a comment\nroot ::= [a-z]+'],
)
def test_grammars_the_engine_parses_pass(grammar: str) -> None:
    from hpcserve.gateway.schema_check import check_grammar

    check_grammar(grammar, "structured_outputs.grammar")


def test_a_request_with_a_bad_grammar_is_a_400_naming_it() -> None:
    from hpcserve.gateway.validate import parse

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"grammar": "root ::= "},
    }
    with pytest.raises(APIError) as err:
        parse("/v1/chat/completions", json.dumps(body).encode())
    assert err.value.status == 400 and err.value.param == "structured_outputs.grammar"


BAD_INNER = {"type": "object", "properties": {"a": {"enum": []}}}
GOOD_INNER = {"type": "object", "properties": {"a": {"type": "string"}}}


def _tags(schema: Any) -> list[dict[str, Any]]:
    return [{"begin": "<a>", "schema": schema, "end": "</a>"}]


@pytest.mark.parametrize(
    ("field", "make", "where"),
    [
        (
            "response_format",
            lambda s: {"type": "structural_tag", "structures": _tags(s), "triggers": ["<a>"]},
            "response_format.structures[0].schema",
        ),
        (
            "response_format",
            lambda s: {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": s}, "end": "</a>"}},
            "response_format.format.content.json_schema",
        ),
        (
            "structured_outputs",
            lambda s: {"structural_tag": json.dumps({"structures": _tags(s), "triggers": ["<a>"]})},
            "structured_outputs.structural_tag.structures[0].schema",
        ),
    ],
)
def test_schemas_inside_structural_tags_are_checked(field: str, make: Any, where: str) -> None:
    from hpcserve.gateway.validate import parse

    def body(schema: Any) -> bytes:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        return json.dumps({**chat, field: make(schema)}).encode()

    with pytest.raises(APIError) as err:
        parse("/v1/chat/completions", body(BAD_INNER))
    assert err.value.status == 400 and err.value.message.startswith(where), err.value.message
    parse("/v1/chat/completions", body(GOOD_INNER))
