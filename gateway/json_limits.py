"""Bounds on a request body's JSON, checked on the raw bytes before any decode.

What the decoders and the engine cannot take, found by class rather than by field:

- nesting deeper than `MAX_DEPTH` levels: msgspec (and Python's json) decode recursively,
  and a few hundred levels of ``[[[[...`` raised RecursionError, a 500, or worse;
- an integer outside a signed 64-bit int anywhere in the body: vLLM hands the request to
  its engine core over msgpack, which fails on such an int (``top_k: 10**30`` was a 500
  with an empty message); the gateway's own typed fields skip unknown ones unchecked;
- a number that overflows a 64-bit float (``1e400``): infinity to Python's json and vLLM;
- a lone UTF-16 surrogate written as a JSON escape (``"a\\ud800b"``): valid JSON, invalid
  Unicode; vLLM fails with a 500 when it has to encode such a string (a stop string,
  bad_words, request_id).

Cost on the hot path: one compiled pass (gateway/_json_scan.c `scan`) that counts the
nesting and finds runs of 19 digits outside strings, jumping over each string with memchr
(docs/architecture.md has the measured cost per chat body). Only a body that nests too deep
or holds such a run is looked at closely, and only a real offender is refused: the error
names the field (``param``) and the limit. Lone surrogates,
NaN/Infinity and numbers that overflow a double need no scan: msgspec refuses them while
decoding (surrogates even in fields it skips; a float it skips reaches vLLM, which refuses
an infinite value with a 400), and `explain_decode_error` then says which field holds them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from hpcserve.gateway.errors import APIError, bad_request
from hpcserve.gateway.json_scan import scan

MAX_DEPTH = 128  # JSON arrays/objects inside each other; vLLM's own schema limit is 64
INT_MIN = -(2**63)
INT_MAX = 2**63 - 1

# The body in three classes: digits -> "0", "[" and "{" -> "[", anything else -> " ".
_CLASSES = bytes(0x30 if 0x30 <= c <= 0x39 else 0x5B if c in b"[{" else 0x20 for c in range(256))
_LONG_NUMBER = b"0" * 19  # the shortest integer outside a signed 64-bit int has 19 digits
MAX_WALKED_BYTES = 256 * 1024  # a body this big at most is decoded to name the bad field
# Opening brackets -> 1, closing ones -> -1 (as int8), anything else -> 0.
_STEPS = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))
_DIGITS = re.compile(rb"0+")
_SURROGATE = re.compile("[\ud800-\udfff]")
_KEY_BEFORE = re.compile(rb'"((?:[^"\\]|\\.){0,64})"\s*:\s*-?$')


class _Huge(int):
    """An integer literal too long to be worth converting (Python limits int parsing)."""


def check_body(body: bytes) -> None:
    """Raise a 400 APIError naming the field and the limit, or return (the body may still be
    invalid JSON or the wrong shape: the decoders report that)."""
    depth, long_number = scan(body)
    if depth > MAX_DEPTH:
        raise APIError(
            400,
            f"Request body nests JSON arrays/objects {depth} levels deep; the limit is "
            f"{MAX_DEPTH} levels",
            code="nesting_too_deep",
        )
    if long_number:  # a number of 19+ digits
        if len(body) <= MAX_WALKED_BYTES:
            check_values(body)  # names the field
        else:
            outside_strings = _outside_strings(body)
            _check_numbers(outside_strings, outside_strings.translate(_CLASSES))


def scan_reference(body: bytes) -> tuple[int, bool]:
    """What `_json_scan.scan` computes, in Python: (nesting depth, whether a run of 19+
    digits stands outside strings). The definition the compiled pass is tested against."""
    return nesting_depth(body), _LONG_NUMBER in _outside_strings(body).translate(_CLASSES)


def nesting_depth(body: bytes) -> int:
    """How deep arrays and objects nest, counting brackets outside strings."""
    import numpy as np

    steps = np.frombuffer(_outside_strings(body).translate(_STEPS), dtype=np.int8)
    if not len(steps):
        return 0
    return max(0, int(np.cumsum(steps, dtype=np.int64).max()))


def _outside_strings(body: bytes) -> bytes:
    """The body with what is inside JSON strings blanked (escapes dropped first, so that
    every quote left opens or closes a string), in vectorised passes: a few milliseconds
    for megabytes, whatever the body holds (a regex over strings backtracks)."""
    import numpy as np  # only here: the close look at a suspect body

    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    inside = (np.cumsum(text == 0x22, dtype=np.int64) & 1).astype(bool)
    return np.where(inside, np.uint8(0x20), text).tobytes()


def _check_numbers(outside_strings: bytes, numbers: bytes) -> None:
    """The long integers of a body too big to walk for field names (`MAX_WALKED_BYTES`);
    `numbers` is `outside_strings` in `_CLASSES`."""
    at = numbers.find(_LONG_NUMBER)
    while at >= 0:
        run = _DIGITS.match(numbers, at)
        assert run is not None
        end = run.end()
        if outside_strings[end : end + 1] not in (b".", b"e", b"E"):  # not a float
            start = at - 1 if outside_strings[at - 1 : at] == b"-" else at
            if end - at > 40 or not INT_MIN <= int(outside_strings[start:end]) <= INT_MAX:
                raise bad_request(
                    "Request body holds an integer outside a signed 64-bit int (-2**63 to "
                    f"2**63-1): {outside_strings[start:end][:30].decode()}..."
                )
        at = numbers.find(_LONG_NUMBER, end)


def check_values(body: bytes) -> None:
    """Raise a 400 for the first integer outside int64, number that overflows a double or
    string with a lone surrogate in a JSON body, naming its field; return if there is none
    or the body is not JSON."""
    try:
        data = json.loads(
            body,
            parse_int=_parse_int,
            parse_constant=_no_constant,
        )
    except (ValueError, RecursionError):
        return  # not JSON (or NaN/Infinity): the typed decode says what is wrong
    for path, value in _leaves(data, ""):
        param = shown_path(path) if path else None
        where = param or "(top level)"
        if isinstance(value, str):
            if (found := _SURROGATE.search(value)) is not None:
                raise bad_request(
                    f"{where}: the string holds a lone UTF-16 surrogate "
                    f"(\\u{ord(found.group()):04x} at character {found.start()}), which is "
                    "not valid Unicode; send the text as UTF-8 or as a surrogate pair",
                    param=param,
                )
        elif isinstance(value, int) and not isinstance(value, bool):
            if isinstance(value, _Huge) or not INT_MIN <= value <= INT_MAX:
                shown = "with more than 40 digits" if isinstance(value, _Huge) else str(value)
                raise bad_request(
                    f"{where}: integer {shown} is out of range: integers must lie within "
                    "a signed 64-bit int, -2**63 to 2**63-1",
                    param=param,
                )
        elif isinstance(value, float) and value in (float("inf"), float("-inf")):
            raise bad_request(
                f"{where}: the number is out of the range of a 64-bit float (about 1.8e308)",
                param=param,
            )


def _leaves(data: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, value) for every scalar and every object key, in document order; the depth is
    bounded by `check_body` before this runs."""
    stack: list[tuple[str, Any, bool]] = [(path, data, False)]
    while stack:
        path, value, is_key = stack.pop()
        if is_key or not isinstance(value, dict | list):
            yield path, value
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                at = f"{path}.{key}" if path else str(key)
                stack.append((at, item, False))
                stack.append((at, key, True))
        else:
            stack.extend(
                (f"{path}[{i}]", item, False) for i, item in reversed(list(enumerate(value)))
            )


def shown_path(path: str, limit: int = 200) -> str:
    """A field path fit for an error body: client-chosen keys may hold lone surrogates
    (escaped here, or the answer itself could not be encoded) and be of any length."""
    path = path.encode("utf-8", "backslashreplace").decode("utf-8")
    return path if len(path) <= limit else path[: limit - 3] + "..."


def _parse_int(text: str) -> int:
    return _Huge(0) if len(text) > 40 else int(text)


def _no_constant(text: str) -> None:
    raise ValueError(text)


def explain_decode_error(message: str, body: bytes) -> tuple[str, str | None]:
    """A clearer message (and param) for a msgspec DecodeError: the field holding a lone
    surrogate (raised from here as a 400), or NaN/Infinity (``temperature: NaN is not a JSON
    number``). Otherwise the message as it came."""
    if "surrogate" in message or "truncated" in message:
        check_values(body)  # raises for a lone surrogate, naming the field
    at = message.rpartition("(byte ")[2].rstrip(")")
    if not at.isdigit():
        return message, None
    offset = int(at)
    if body.startswith(b"-", offset):
        offset += 1
    for literal in (b"NaN", b"Infinity"):
        if body.startswith(literal, offset):
            key = _KEY_BEFORE.search(body, max(0, offset - 80), offset)
            name = key.group(1).decode("utf-8", "replace") if key else None
            where = f"{name}: " if name else ""
            return (
                f"{where}{literal.decode()} is not a JSON number (JSON has no NaN or "
                f"Infinity; byte {offset})",
                name,
            )
    return message, None
