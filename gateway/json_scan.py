"""gateway/_json_scan.c, the compiled passes over a request body's JSON, loaded once:
`scan` (nesting depth and long digit runs, for json_limits.py) and `message_spans` (where a
chat body's messages lie, each with a keyed hash of the bytes of the messages up to it: the
prompt cache's keys for the prefix hints)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcserve.contracts.compiled_extension import load_extension

# gateway/_json_scan.c's JSON_SCAN_API_VERSION is 2.
_json_scan: Any = load_extension("hpcserve.gateway._json_scan", "gateway/_json_scan.c", 2)

scan: Callable[[bytes], tuple[int, bool]] = _json_scan.scan
message_spans: Callable[[bytes], list[tuple[int, int, int]] | None] = _json_scan.message_spans
