"""Members appended to a JSON object's bytes (contracts/json_members.py): the result decodes
to the object with the members added, whatever whitespace the client wrote."""

from __future__ import annotations

import msgspec
import pytest

from hpcserve.contracts.cache_salt import salt_member, salted_body
from hpcserve.contracts.json_members import with_members

SALT = b'"cache_salt":"hpcs-1"'
USAGE = b'"stream_options":{"include_usage":true}'


@pytest.mark.parametrize(
    ("body", "members", "expected"),
    [
        (b'{"a":1}', (SALT,), b'{"a":1,"cache_salt":"hpcs-1"}'),
        (b'{"a":1}', (SALT, USAGE),
         b'{"a":1,"cache_salt":"hpcs-1","stream_options":{"include_usage":true}}'),
        (b'{"a":1} \n', (SALT,), b'{"a":1,"cache_salt":"hpcs-1"}'),  # trailing whitespace
        (b'{"a":1 \r\n}', (SALT,), b'{"a":1 \r\n,"cache_salt":"hpcs-1"}'),
        (b"{}", (SALT,), b'{"cache_salt":"hpcs-1"}'),
        (b"{ \t}", (SALT,), b'{ \t"cache_salt":"hpcs-1"}'),
        (b'{"a":"}"}', (SALT,), b'{"a":"}","cache_salt":"hpcs-1"}'),  # a brace in a string
        (b'{"a":{"b":[1,{}]}}', (SALT,), b'{"a":{"b":[1,{}]},"cache_salt":"hpcs-1"}'),
    ],
)  # fmt: skip
def test_members_follow_the_last_member(body: bytes, members: tuple[bytes, ...],
                                        expected: bytes) -> None:  # fmt: skip
    out = with_members(body, *members)
    assert out == expected
    decoded = msgspec.json.decode(out)
    assert decoded == {
        **msgspec.json.decode(body),
        **msgspec.json.decode(b"{" + b",".join(members) + b"}"),
    }


@pytest.mark.parametrize("body", [b"", b"  ", b"[1]", b'"x"', b'{"a":1', b"1"])
def test_a_body_that_is_not_an_object_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        with_members(body, SALT)


def test_a_salted_body_is_the_body_with_the_salt_member() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    assert salted_body(body, "hpcs-1", replace=False) == with_members(body, SALT)
    assert salt_member("hpcs-1") == SALT
    # a client's own salt is replaced, not left beside ours
    theirs = b'{"model":"m","cache_salt":"mine","messages":[]}'
    assert msgspec.json.decode(salted_body(theirs, "hpcs-1", replace=True)) == {
        "model": "m", "messages": [], "cache_salt": "hpcs-1"}  # fmt: skip
