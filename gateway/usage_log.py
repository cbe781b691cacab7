"""The writer of usage records (contracts/usage.py): one append per served request.

Cost on the event loop: a msgspec encode and one write(2) (the same as the audit log's line,
docs/benchmarks.md). A day's file is opened once, when the first record of that UTC day
comes. A thread looks every `SYNC_S` and fdatasyncs the open file if it was written to
since (never on the loop; a write sets a flag, takes no lock), so a power loss loses at most
about that much; a process crash loses nothing written. A write
that fails (disk full) is counted (`hpcserve_gateway_usage_failures_total`), logged once per
file, and the request goes on: the client has its answer either way.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from hpcserve.contracts.private_files import open_private_append, private_dir
from hpcserve.contracts.usage import SYNC_S, UsageRecord, encode, file_name

log = logging.getLogger(__name__)
_DAY_S = 86400


class UsageLog:
    """Appends UsageRecords to `<usage_dir>/<day>.<source>.<host>.jsonl`."""

    def __init__(
        self,
        usage_dir: str | os.PathLike[str],
        source: str,
        on_failure: Callable[[], None] | None = None,
        sync_s: float = SYNC_S,
    ) -> None:
        self.dir = Path(usage_dir)
        self.source = source
        self.host = socket.gethostname().split(".")[0] or "host"
        self._on_failure = on_failure
        self._fd = -1
        self._day_end = 0.0  # the open file takes records that end before this
        self._failed_path: Path | None = None
        self._written = False  # a plain flag (atomic under the GIL): no lock per write
        self._closed = threading.Event()
        self._lock = threading.Lock()  # between a day's switch and the sync thread
        self._sync_s = sync_s
        private_dir(self.dir)
        self._syncer = threading.Thread(target=self._sync_loop, name="usage-sync", daemon=True)
        self._syncer.start()
        log.info("usage records: %s (%s)", self.dir, source)

    def write(self, record: UsageRecord) -> None:
        line = encode(record)
        try:
            if record.end >= self._day_end or self._fd < 0:
                self._switch(record.end)
            os.write(self._fd, line)
        except OSError as err:
            if self._on_failure is not None:
                self._on_failure()
            path = self.dir / file_name(record.end, self.source, self.host)
            if self._failed_path != path:
                self._failed_path = path
                log.error("cannot write usage records to %s: %s", path, err)
            return
        self._written = True

    def _switch(self, epoch: float) -> None:
        path = self.dir / file_name(epoch, self.source, self.host)
        fd = open_private_append(path)
        with self._lock:
            old, self._fd = self._fd, fd
            self._day_end = (int(epoch) // _DAY_S + 1) * _DAY_S
        if old >= 0:
            self._sync(old)
            os.close(old)

    def _sync(self, fd: int) -> None:
        try:
            os.fdatasync(fd)
        except OSError as err:
            log.warning("cannot sync the usage records in %s: %s", self.dir, err)

    def _sync_loop(self) -> None:
        while not self._closed.wait(self._sync_s):
            if self._written:
                self._written = False
                with self._lock:
                    if self._fd >= 0:
                        self._sync(self._fd)

    def close(self) -> None:
        self._closed.set()
        self._syncer.join(5)
        with self._lock:
            if self._fd >= 0:
                self._sync(self._fd)
                os.close(self._fd)
                self._fd = -1
