"""Request ids: 24 hex characters (96 bits) from the kernel's random source, drawn 256 at a
time. `os.urandom(12)` per request is a getrandom(2) each, ~2 us on a VM; one call fills 256.

A forked child drops the ids its parent had drawn and not used, so that no two processes
hand out the same one. `list.pop` is atomic under the GIL: threads never share an id.
"""

from __future__ import annotations

import os

_BATCH = 256
_ready: list[str] = []


def new_request_id() -> str:
    while True:
        try:
            return _ready.pop()
        except IndexError:
            text = os.urandom(12 * _BATCH).hex()
            _ready.extend([text[i : i + 24] for i in range(0, len(text), 24)])


os.register_at_fork(after_in_child=_ready.clear)
