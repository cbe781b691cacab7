"""A SQLite database in WAL mode that several processes open at the same moment: gateways on
one host sharing a state dir (hpcserve-gateway@PORT.service), a gateway's workers, the batch
runner beside them.

SQLite answers "database is locked" at once, without waiting for its busy timeout, to a
connection switching the journal to WAL while another connection opens or switches the same
file. The switch is therefore retried until the busy timeout; WAL is a property of the file,
so a connection finding it already set does not ask again.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from hpcserve.contracts.private_files import private_file

BUSY_TIMEOUT_S = 5.0
_RETRY_S = 0.01


def connect_wal(path: Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> sqlite3.Connection:
    """A connection (autocommit, usable from any thread) to the owner-only database file
    `path` (made if absent), in WAL mode with synchronous=FULL and the busy timeout set.
    Raises sqlite3.OperationalError if the file stays locked past the busy timeout."""
    db = sqlite3.connect(
        private_file(path),
        timeout=busy_timeout_s,
        check_same_thread=False,
        isolation_level=None,
    )
    try:  # the busy timeout is connect's `timeout`
        deadline = time.monotonic() + busy_timeout_s
        while True:
            try:
                if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as err:
                if not _is_busy(err) or time.monotonic() >= deadline:
                    raise
                time.sleep(_RETRY_S)
        db.execute("PRAGMA synchronous=FULL")
    except BaseException:
        db.close()
        raise
    return db


def _is_busy(err: sqlite3.OperationalError) -> bool:
    code = getattr(err, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
