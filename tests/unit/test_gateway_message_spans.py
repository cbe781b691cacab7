"""gateway/_json_scan.c message_spans: where a chat body's messages lie, each with a keyed
hash of the messages' bytes up to it, or None wherever reading the bytes could differ from
decoding them."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcserve.gateway.json_scan import message_spans

USER = b'{"role":"user","content":"hi"}'


def items(body: bytes) -> list[bytes] | None:
    spans = message_spans(body)
    if spans is None:
        return None
    return [body[start:stop] for _, start, stop in spans]


@pytest.mark.parametrize(
    ("body", "want"),
    [
        (b'{"model":"m","messages":[' + USER + b"]}", [USER]),
        (b' {\n "messages" : [ ' + USER + b" ,\t" + USER + b" ] , \"n\": 1 }\r\n", [USER, USER]),
        (b'{"messages":[{"role":"user","content":"a}],\\"{["}]}',
         [b'{"role":"user","content":"a}],\\"{["}']),  # brackets and quotes in a string
        (b'{"a":{"messages":[1]},"messages":[' + USER + b"]}", [USER]),  # nested: not it
        (b'{"messages":[' + USER + b'],"tools":null}', [USER]),
        (b'{"tools": [ ],"messages":[' + USER + b"]}", [USER]),
        (b'{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}',
         [b'{"role":"user","content":[{"type":"text","text":"x"}]}']),
        # Read by decoding instead:
        (b'{"messages":[' + USER + b'],"tools":[{"type":"function"}]}', None),
        (b'{"m\\u0065ssages":[' + USER + b"]}", None),  # a key with an escape
        (b'{"messages":[' + USER + b'],"messages":[' + USER + b"]}", None),  # named twice
        (b'{"messages":[]}', None),
        (b'{"messages":[' + USER + b',"text"]}', None),  # an item not an object
        (b'{"messages":{"role":"user"}}', None),
        (b'{"prompt":"x"}', None),
        (b"[" + USER + b"]", None),
        (b"{}", None),
        (b"", None),
        (b'{"messages":[' + USER, None),  # cut short
        (b'{"messages":[{"role":"user","content":"hi}', None),
        (b'{"messages":[' + USER + b"]", None),
        (b'{"messages"', None),
    ],
)  # fmt: skip
def test_message_spans_on_a_table_of_bodies(body: bytes, want: list[bytes] | None) -> None:
    assert items(body) == want


def test_a_key_names_every_message_up_to_its_own() -> None:
    system = b'{"role":"system","content":"s"}'
    first = message_spans(b'{"messages":[' + system + b"," + USER + b"]}")
    longer = message_spans(
        b'{"model":"m", "messages": [' + system + b", " + USER + b"," + USER + b'], "n": 2}'
    )
    other = message_spans(b'{"messages":[' + USER + b"," + USER + b"]}")
    assert first is not None and longer is not None and other is not None
    keys, longer_keys, other_keys = ([k for k, _, _ in spans] for spans in (first, longer, other))
    assert longer_keys[:2] == keys, "the same leading messages, the same keys"
    assert len(set(longer_keys)) == 3, "the same message again: a longer prefix, a new key"
    assert other_keys[0] != keys[0] and other_keys[1] != keys[1], "an earlier message differs"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=80), min_size=2, max_size=8, unique=True))
def test_different_bytes_have_different_keys(contents: list[bytes]) -> None:
    """Every length around the 16-byte steps, and contents that differ in one byte."""
    messages = [b'{"c":"' + c.hex().encode() + b'"}' for c in contents]
    spans = message_spans(b'{"messages":[' + b",".join(messages) + b"]}")
    assert spans is not None
    assert len({key for key, _, _ in spans}) == len(messages)


def test_message_spans_takes_only_bytes_like_bodies() -> None:
    with pytest.raises(TypeError):
        message_spans('{"messages":[{}]}')  # type: ignore[arg-type]
    for body in (bytearray, memoryview):
        assert message_spans(body(b'{"messages":[' + USER + b"]}")) == message_spans(
            b'{"messages":[' + USER + b"]}"
        )


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={"content": _text | st.none(), "name": _text},
)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(_message, min_size=1, max_size=6),
    extra=st.dictionaries(st.sampled_from(["model", "n", "stop", "x"]), _text | st.integers()),
    spaced=st.booleans(),
    ascii_only=st.booleans(),
)
def test_each_span_decodes_to_its_message(
    messages: list[dict[str, Any]], extra: dict[str, Any], spaced: bool, ascii_only: bool
) -> None:
    separators = (", ", ": ") if spaced else (",", ":")
    body = json.dumps(
        {**extra, "messages": messages}, separators=separators, ensure_ascii=ascii_only
    ).encode()
    found = items(body)
    assert found is not None
    assert [msgspec.json.decode(item) for item in found] == messages


def test_mutated_bodies_never_crash_and_valid_ones_split_as_decoded() -> None:
    """Bytes cut, dropped and inserted at random (structural bytes mostly) into chat bodies:
    the scan reads nothing past the body, and wherever the result is valid JSON and the scan
    finds messages, they are the decoded body's messages."""
    rng = random.Random(7)
    bodies = [
        json.dumps({
            "model": "m",
            "messages": [{"role": "user", "content": 'hi "x" \\ }]'}, {"role": "assistant"}],
            "tools": None,
        }).encode(),
        b'{"messages":[{"a":[1,{"b":"]"}]}],"n":1}',
    ]  # fmt: skip
    alphabet = b'{}[]",:\\ nul0123456789abtrue\n'
    checked = 0
    for _ in range(30_000):
        body = bytearray(rng.choice(bodies))
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(len(body) + 1)
            op = rng.random()
            if op < 0.4 and len(body) > 1:
                del body[min(at, len(body) - 1)]
            elif op < 0.8:
                body[at:at] = bytes([rng.choice(alphabet)])
            else:
                del body[at:]
        spans = message_spans(bytes(body))
        try:
            data = msgspec.json.decode(bytes(body))
        except msgspec.DecodeError:
            continue
        if spans is not None:
            checked += 1
            assert [msgspec.json.decode(body[s:e]) for _, s, e in spans] == data["messages"]
    assert checked > 1000
