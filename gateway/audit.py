"""The audit log: one JSON line per client request, saying who did what, when, and what came
of it; never what was said.

Fields: `time` (UTC, ms), `tenant` ("" when the key was refused), `key_id` (the first 12 hex
digits of the key's sha256, as the config lists it: it names a key without revealing it),
`client` (address), `method`, `path`, `model`, `prompt_tokens`, `completion_tokens`,
`status`, `replica` (the replica that served it, if any), `request_id` (the client's
X-Request-Id, else one the gateway made and sent on to the engine: vLLM's response id then
carries it, `chatcmpl-<request_id>`). Never a prompt, a completion or a key.

Where (`gateway.audit_log`): "-" (the default) into the gateway's own log stream, stderr,
each line after "audit "; a file path, appended to (mode 0600, made if absent, its
directory too); "" for none. The health and metrics endpoints are not audited.

Cost: a msgspec encode and one write(2) per request, on the event loop, no lock and no
logging module (docs/benchmarks.md, gateway audit log). A line of a few hundred bytes is
written whole by one append, so gateways on one host can share a file. A write that fails
(disk full) is counted (hpcserve_gateway_audit_failures_total) and logged once, and the
request goes on.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from hpcserve.contracts.private_files import open_private_append, private_dir

log = logging.getLogger(__name__)

SERVICE_LOG = "-"


class AuditRecord(msgspec.Struct, omit_defaults=False):
    time: str
    tenant: str
    key_id: str
    client: str
    method: str
    path: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    status: int
    replica: str
    request_id: str


_encode = msgspec.json.Encoder().encode


# The last second utc_time formatted (strftime costs more than the rest of a line).
_second: tuple[int, str] = (-1, "")


def utc_time(now: float) -> str:
    global _second
    second, text = _second
    if int(now) != second:
        second = int(now)
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second = (second, text)
    return f"{text}.{int(now * 1000) % 1000:03d}Z"


class AuditLog:
    """Writes AuditRecords to one destination; `enabled` is False for "" (off)."""

    def __init__(self, destination: str, on_failure: Callable[[], None] | None = None) -> None:
        self.destination = destination
        self.enabled = bool(destination)
        self._prefix = b""
        self._fd = -1
        self._path: Path | None = None
        self._failed_once = False
        self._on_failure = on_failure
        if destination == SERVICE_LOG:
            self._fd = sys.stderr.fileno()
            self._prefix = b"audit "
        elif destination:
            self._path = Path(destination)
            if not self._path.parent.is_dir():
                private_dir(self._path.parent)
            self._open()
            log.info("audit log: %s", self._path)

    def _open(self) -> None:
        assert self._path is not None
        self._fd = open_private_append(self._path)

    def write(self, record: AuditRecord) -> None:
        if self._fd < 0 and self._path is None:
            return
        try:
            if self._fd < 0:
                self._open()  # written to again after close(): a gateway started again
            os.write(self._fd, self._prefix + _encode(record) + b"\n")
        except OSError as err:
            if self._on_failure is not None:
                self._on_failure()
            if not self._failed_once:
                self._failed_once = True
                log.error("cannot write the audit log %s: %s", self.destination, err)

    def close(self) -> None:
        if self._path is not None and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
