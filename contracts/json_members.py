"""Members added to a JSON object's bytes without decoding it.

The gateway adds keys of its own to a validated request body (the tenant's `cache_salt`,
`stream_options` that ask for usage): appending them to the bytes costs one copy, where a
decode and an encode of a long chat's messages cost ~100,000 instructions
(docs/benchmarks.md, issue 23's eleventh pass).
"""

from __future__ import annotations

_CLOSE = 0x7D  # }
_OPEN = 0x7B  # {
_SPACE = frozenset(b" \t\r\n")


def with_members(body: bytes, *members: bytes) -> bytes:
    """`body`, one JSON object (validated by the caller), with `members` (each an encoded
    `"key":value`) after its last member. The caller knows none of the keys is in it
    already: a key twice is a body that parsers read differently."""
    end = len(body) - 1
    while end >= 0 and body[end] in _SPACE:
        end -= 1
    if end < 0 or body[end] != _CLOSE:
        raise ValueError("not a JSON object: the body does not end with '}'")
    last = end - 1
    while last >= 0 and body[last] in _SPACE:
        last -= 1
    separator = b"" if last >= 0 and body[last] == _OPEN else b","
    return b"".join((memoryview(body)[:end], separator, b",".join(members), b"}"))
