"""JSON schemas (and regexes) that the engine's grammar backend can compile, checked before
the request is routed.

vLLM's structured output in "auto" mode validates a schema with xgrammar and, when xgrammar
refuses it, with llguidance; but its engine core compiles every request with the one
backend that the first structured request chose, in practice xgrammar. A schema that
xgrammar refuses and llguidance accepts therefore passes vLLM's own check and then fails in
the engine: a 500 with "Internal server error" (``"enum": []`` nested in a property, seen
on vLLM 0.32.0), and a few make llguidance expand counts until the API server is killed for
memory (``"minItems": 10**9`` on an array without ``items``). The rules here are the
classes that xgrammar 0.2.8 (json_schema_converter.cc, regex_converter.cc) refuses,
measured against it (tests/unit/test_gateway_schema_check.py compiles what this accepts):

- ``enum`` must be a non-empty array; a ``false`` subschema (other than ``items``) accepts
  nothing;
- numeric ranges must hold a value: ``minimum`` <= ``maximum`` with exclusivity counted;
  for an integer type the bounds are whole numbers within a signed 64-bit int and leave an
  integer between them;
- ``minLength``/``maxLength``, ``minItems``/``maxItems``, ``minProperties``/
  ``maxProperties``, ``minContains``/``maxContains``: min <= max, each at most
  `MAX_COUNT` (items, properties) or `MAX_LENGTH` (string length);
- xgrammar's strict mode allows no array items beyond ``prefixItems`` unless ``items`` is
  given, and no object properties beyond ``properties`` unless ``additionalProperties``,
  ``patternProperties`` or ``unevaluatedProperties`` allow them: ``minItems`` /
  ``minProperties`` must fit (a schema without ``type`` counts as an array when it has
  ``items``/``prefixItems``, as an object when it has ``properties``/
  ``additionalProperties``, as xgrammar reads it); ``prefixItems`` holds schema objects only;
- ``$ref`` must point inside the schema (``#`` or ``#/...``) at something that exists, and
  no chain of ``$ref``/``allOf``/``anyOf``/``oneOf`` may lead back to where it started
  without an object property or array item in between (``{"$ref": "#"}`` matches nothing:
  the engine rejects its first token, a 500);
- regexes (``pattern``, ``patternProperties`` keys, ``structured_outputs.regex``) must
  compile, and use none of: backreferences, lookbehind, ``\\p{..}`` classes, word
  boundaries and anchors other than ``^``/``$``, a NUL character.

What stays with the engine: EBNF/Lark grammars (``structured_outputs.grammar``) and
structural tags, which no cheap check here can parse the way xgrammar does; a failure there
is answered as the engine answers it, in OpenAI's shape (gateway/errors.py).
"""

from __future__ import annotations

import math
import re
from typing import Any, NoReturn, TypeGuard
from urllib.parse import unquote

from hpcserve.gateway.errors import bad_request
from hpcserve.gateway.json_limits import INT_MAX, INT_MIN, shown_path

MAX_DEPTH = 64  # objects/arrays in a schema, as vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING
MAX_COUNT = 10_000  # minItems, maxItems, minProperties, maxProperties, minContains, ...
MAX_LENGTH = 100_000  # minLength, maxLength (longer than any model's context anyway)

_ONE_SCHEMA = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "additionalItems",
    "contains", "unevaluatedItems", "not", "if", "then", "else",
)  # fmt: skip
# Where `false` means "no more of these", not "no value": OpenAI's strict mode requires
# `additionalProperties: false`, and xgrammar compiles each of these.
_FALSE_MEANS_NO_MORE = frozenset(
    {"additionalProperties", "unevaluatedProperties", "unevaluatedItems", "not"}
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_PASS_THROUGH = ("allOf", "anyOf", "oneOf")  # no input consumed on the way to a member
_COUNTS = (
    ("minItems", "maxItems", MAX_COUNT),
    ("minProperties", "maxProperties", MAX_COUNT),
    ("minContains", "maxContains", MAX_COUNT),
    ("minLength", "maxLength", MAX_LENGTH),
)
# Escapes xgrammar's regex converter refuses: \p{..} classes, backreferences, word
# boundaries and anchors other than ^ and $.
_BAD_ESCAPES = {
    "p": "a Unicode property class (\\p{...})",
    "P": "a Unicode property class (\\P{...})",
    "k": "a named backreference (\\k<...>)",
    "b": "a word boundary (\\b)",
    "B": "a word boundary (\\B)",
    "A": "an anchor other than ^ and $ (\\A)",
    "Z": "an anchor other than ^ and $ (\\Z)",
    "z": "an anchor other than ^ and $ (\\z)",
    "G": "an anchor other than ^ and $ (\\G)",
    **{d: f"a backreference (\\{d})" for d in "123456789"},
}
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_NAMED_GROUP = re.compile(r"(?<!\\)\(\?<(?=[A-Za-z_])")


class _Schema:
    """One schema document: its root (what ``#`` refers to) and the param it came in."""

    def __init__(self, root: Any, param: str) -> None:
        self.root = root
        self.param = param
        self.refs: list[tuple[str, dict[str, Any], Any]] = []  # (path, node, target)

    def fail(self, path: str, problem: str) -> Exception:
        at = f"{self.param}{path}"
        return bad_request(f"{shown_path(at)}: {problem}", param=shown_path(self.param))


def check_depth(schema: Any, param: str) -> None:
    """At most `MAX_DEPTH` levels of objects and arrays (before any recursive walk)."""
    level = [schema] if isinstance(schema, dict | list) else []
    for _ in range(MAX_DEPTH):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
        if not level:
            return
    too_deep(param)


def too_deep(param: str) -> NoReturn:
    raise bad_request(
        f"{param}: the schema nests objects and arrays more than {MAX_DEPTH} levels deep "
        f"(the limit, as vLLM's)",
        param=param,
    )


def check_schema(schema: Any, param: str) -> None:
    """Raise a 400 naming where in the schema (under `param`) the problem is, or return."""
    doc = _Schema(schema, param)
    if schema is False:
        raise doc.fail("", "the schema `false` accepts no value")
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue  # `true`, or a shape the JSON Schema meta-check reports
        _check_node(doc, path, node)
        for key in _ONE_SCHEMA:
            if key in node and not (node[key] is False and key in _FALSE_MEANS_NO_MORE):
                stack.append((f"{path}.{key}", _no_false(doc, f"{path}.{key}", node[key])))
        items = node.get("items")
        if isinstance(items, list):  # draft 4-2019 tuple form
            for i, item in enumerate(items):
                stack.append((f"{path}.items[{i}]", _no_false(doc, f"{path}.items[{i}]", item)))
        elif "items" in node:
            stack.append((f"{path}.items", items))  # `items: false` is fine: no more items
        for key in _SCHEMA_LISTS:
            members = node.get(key)
            if isinstance(members, list):
                for i, member in enumerate(members):
                    at = f"{path}.{key}[{i}]"
                    if key == "prefixItems" and member is True:
                        raise doc.fail(at, "xgrammar takes only schema objects in prefixItems")
                    stack.append((at, _no_false(doc, at, member)))
        for key in _SCHEMA_MAPS:
            members = node.get(key)
            if isinstance(members, dict):
                for name, member in members.items():
                    at = f"{path}.{key}.{name}"
                    stack.append((at, _no_false(doc, at, member)))
                    if key == "patternProperties":
                        check_regex(str(name), doc.param, f"{path}.patternProperties")
    _check_ref_cycles(doc)


def _no_false(doc: _Schema, path: str, node: Any) -> Any:
    if node is False:
        raise doc.fail(path, "the schema `false` accepts no value (xgrammar refuses it)")
    return node


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def _check_node(doc: _Schema, path: str, node: dict[str, Any]) -> None:
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise doc.fail(f"{path}.enum", "enum must be a non-empty array")
    types = _types(node)
    _check_range(doc, path, node, "integer" in types)
    for low_key, high_key, limit in _COUNTS:
        low, high = node.get(low_key), node.get(high_key)
        for key, value in ((low_key, low), (high_key, high)):
            if _is_number(value) and value > limit:
                raise doc.fail(
                    f"{path}.{key}", f"{key} {value} is over the gateway's limit of {limit}"
                )
        if _is_number(low) and _is_number(high) and low > high:
            raise doc.fail(path, f"{low_key} {low} is greater than {high_key} {high}")
    # xgrammar takes a schema without a type for an array when it has items or prefixItems,
    # and for an object when it has properties or additionalProperties.
    array = "array" in types or (not types and ("items" in node or "prefixItems" in node))
    obj = "object" in types or (
        not types and ("properties" in node or "additionalProperties" in node)
    )
    min_items = node.get("minItems")
    if array and _is_number(min_items) and min_items > 0:
        items = node.get("items")
        prefix = node.get("prefixItems")
        allowed: float = len(prefix) if isinstance(prefix, list) else 0
        if isinstance(items, list):
            allowed = len(items)
        elif isinstance(items, dict) or items is True:
            allowed = math.inf
        if min_items > allowed:
            raise doc.fail(
                f"{path}.minItems",
                f"minItems {min_items} but the schema allows {allowed} item(s): the engine's "
                "grammar (xgrammar, strict) allows no items beyond prefixItems unless "
                "'items' is given",
            )
    min_props = node.get("minProperties")
    if obj and _is_number(min_props) and min_props > 0:
        props = node.get("properties")
        allowed_props: float = len(props) if isinstance(props, dict) else 0
        if (
            node.get("additionalProperties", False) is not False
            or node.get("patternProperties")
            or node.get("unevaluatedProperties", False) is not False
        ):
            allowed_props = math.inf
        if min_props > allowed_props:
            raise doc.fail(
                f"{path}.minProperties",
                f"minProperties {min_props} but the schema allows {allowed_props} "
                "propert(ies): the engine's grammar (xgrammar, strict) allows no properties "
                "beyond 'properties' unless additionalProperties or patternProperties allow them",
            )
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_regex(pattern, doc.param, f"{path}.pattern")
    if "$ref" in node:
        doc.refs.append((path, node, _resolve(doc, path, node["$ref"])))


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_range(doc: _Schema, path: str, node: dict[str, Any], integer: bool) -> None:
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    bounds = {k: node[k] for k in keys if _is_number(node.get(k))}
    if not bounds:
        return
    for key, value in bounds.items():
        if not math.isfinite(value):
            raise doc.fail(f"{path}.{key}", f"{key} must be a finite number")
        if integer and not float(value).is_integer():
            raise doc.fail(
                f"{path}.{key}", f"{key} {value} must be a whole number for an integer type"
            )
        if integer and not INT_MIN <= value <= INT_MAX:
            raise doc.fail(
                f"{path}.{key}", f"{key} {value} is outside a signed 64-bit int for an integer"
            )
    lows = [
        (bounds[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in bounds
    ]
    highs = [
        (bounds[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in bounds
    ]
    low = max(lows, default=None)  # the tighter bound; exclusive wins a tie
    high = min(highs, key=lambda b: (b[0], not b[1]), default=None)
    if low is None or high is None:
        return
    (lo, lo_open), (hi, hi_open) = low, high
    if integer:
        first = math.floor(lo) + 1 if lo_open else math.ceil(lo)
        last = math.ceil(hi) - 1 if hi_open else math.floor(hi)
        empty = first > last
    else:
        empty = lo > hi or (lo == hi and (lo_open or hi_open))
    if empty:
        raise doc.fail(path, f"no {'integer' if integer else 'number'} lies within {bounds}")


def _resolve(doc: _Schema, path: str, ref: Any) -> Any:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise doc.fail(
            f"{path}.$ref",
            f"$ref {str(ref)[:100]!r}: only references within the schema ('#' or '#/...') "
            "are supported",
        )
    target = doc.root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            raise doc.fail(f"{path}.$ref", f"$ref {ref[:100]!r} points at nothing in the schema")
    return target


def _check_ref_cycles(doc: _Schema) -> None:
    """A chain of $ref / allOf / anyOf / oneOf that comes back to its start consumes no
    input on the way: the grammar either matches nothing or recurses without end."""
    if not doc.refs:
        return
    by_id = {id(node): (path, target) for path, node, target in doc.refs}

    def steps(node: Any) -> list[Any]:
        if not isinstance(node, dict):
            return []
        nxt = [m for key in _PASS_THROUGH for m in (node.get(key) or []) if isinstance(m, dict)]
        if id(node) in by_id:
            nxt.append(by_id[id(node)][1])
        return nxt

    done: set[int] = set()
    for path, start, _ in doc.refs:
        if id(start) in done:
            continue
        on_path: set[int] = set()
        stack: list[tuple[Any, int]] = [(start, 0)]
        while stack:
            node, index = stack.pop()
            if index == 0:
                if id(node) in on_path:
                    raise doc.fail(
                        f"{path}.$ref",
                        "the reference leads back to itself through $ref/allOf/anyOf/oneOf "
                        "without an object property or array item in between (it can match "
                        "nothing, or only by endless recursion)",
                    )
                if id(node) in done:
                    continue
                on_path.add(id(node))
            successors = steps(node)
            if index < len(successors):
                stack.append((node, index + 1))
                stack.append((successors[index], 0))
            else:
                on_path.discard(id(node))
                done.add(id(node))


def check_regex(pattern: str, param: str, path: str = "") -> None:
    """A regex the engine's grammar backend can take, or a 400 naming `param` (the request
    field) and `path` (where under it)."""
    where = shown_path(param + path)
    param = shown_path(param)
    if "\x00" in pattern:
        raise bad_request(f"{where}: the regex holds a NUL character", param=param)
    for escape in _ESCAPE.finditer(pattern):
        problem = _BAD_ESCAPES.get(escape.group(1))
        if problem is not None:
            raise bad_request(
                f"{where}: the regex uses {problem}, which the engine's grammar backend does "
                f"not support (at character {escape.start()})",
                param=param,
            )
    bare = _ESCAPE.sub("", pattern)
    if "(?<=" in bare or "(?<!" in bare:
        raise bad_request(
            f"{where}: the regex uses a lookbehind, which the engine's grammar backend does "
            "not support",
            param=param,
        )
    try:
        re.compile(_NAMED_GROUP.sub(r"(?P<", pattern))  # ECMA's (?<name>...) in Python's terms
    except (re.error, RecursionError, OverflowError) as err:
        raise bad_request(f"{where}: not a valid regex: {err}", param=param) from None


MAX_GRAMMAR_CHARS = 100_000


def check_grammar(grammar: str, param: str) -> None:
    """A grammar the engine's backend parses: EBNF (GBNF), or Lark when no line holds `::=`
    (vLLM's own test, `grammar_is_likely_lark`). vLLM 0.32 compiles grammars with xgrammar
    on its engine core without checking them first, so one that does not parse is a 500
    there: parsed here with the same xgrammar, where it is installed (beside vLLM); a
    gateway without it passes grammars on as they are."""
    if not grammar.strip():
        raise bad_request(f"{param} is empty", param=param)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(
            f"{param} is {len(grammar)} characters, over the gateway's limit of "
            f"{MAX_GRAMMAR_CHARS}",
            param=param,
        )
    try:
        import xgrammar
    except ImportError:
        return
    lark = all("::=" not in _GRAMMAR_COMMENT.sub("", line) for line in grammar.split("\n"))
    try:
        if lark:
            xgrammar.Grammar.from_lark(grammar)
        else:
            xgrammar.Grammar.from_ebnf(grammar)
    except Exception as err:  # xgrammar raises RuntimeError (EBNF) and ValueError (Lark)
        detail = _XGRAMMAR_SOURCE.sub("", str(err)).strip()[:300]
        raise bad_request(
            f"{param} is not {'a Lark' if lark else 'an EBNF'} grammar the engine can parse: "
            f"{detail}",
            param=param,
        ) from None


_GRAMMAR_COMMENT = re.compile(r"(#|//).*$")
# "[20:37:16] /project/cpp/grammar_parser.cc:820: " before xgrammar's own message
_XGRAMMAR_SOURCE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
