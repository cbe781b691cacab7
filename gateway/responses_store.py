"""The Responses API's stored responses: the state behind `store` and `previous_response_id`.

It lives with the gateways, not the engines: vLLM keeps its own Responses state in one
replica's memory (and only with VLLM_ENABLE_RESPONSES_API_STORE), so a next turn routed to
another replica, or sent after that replica drained, would not find it. Here each stored
response is a row of one SQLite database under `gateway.responses_dir` (default
``<state_dir>/responses``, owner-only, WAL, synchronous=FULL: a response is on disk before
its client sees it), which every gateway of the site opens, like the batch store.

A row holds the Response object as the client got it, the input items of its turn (for
GET .../input_items), and `history`: the whole conversation up to and including its output
as chat messages, so that a next turn expands in one read, whatever became of the earlier
turns. Rows belong to a tenant: every read and delete is by (tenant, id), so another
tenant's id is not found. Rows older than `gateway.responses_retention_s` are never returned
and are deleted as new ones are written (at most every `PRUNE_EVERY_S`).

Synchronous and thread-safe (one connection, one lock); the async code calls it through
`asyncio.to_thread`.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from hpcserve.contracts.private_files import private_dir
from hpcserve.gateway.sqlite_wal import connect_wal

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    model TEXT NOT NULL,
    response BLOB NOT NULL,
    input_items BLOB NOT NULL,
    history BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


class StoredResponse(msgspec.Struct, frozen=True):
    id: str
    tenant: str
    created_at: float
    model: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]


_items = msgspec.json.Decoder(list[dict[str, Any]])
_object = msgspec.json.Decoder(dict[str, Any])


class ResponseStore:
    def __init__(self, root: Path | None, retention_s: float) -> None:
        """root: the directory (made owner-only); None keeps the store in memory (tests and
        a gateway built without a state directory: nothing survives its process)."""
        self.retention_s = retention_s
        self._lock = threading.Lock()
        if root is None:
            self._db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        else:
            private_dir(root)
            self._db = connect_wal(root / "responses.sqlite3")
        self._db.executescript(_SCHEMA)
        self._pruned_at = 0.0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def put(self, record: StoredResponse) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.tenant,
                    record.created_at,
                    record.model,
                    msgspec.json.encode(record.response),
                    msgspec.json.encode(record.input_items),
                    msgspec.json.encode(record.history),
                ),
            )
            if now - self._pruned_at >= PRUNE_EVERY_S:
                self._pruned_at = now
                self._prune(now)

    def prune(self, now: float | None = None) -> int:
        with self._lock:
            return self._prune(time.time() if now is None else now)

    def _prune(self, now: float) -> int:
        gone = self._db.execute(
            "DELETE FROM responses WHERE created_at < ?", (now - self.retention_s,)
        ).rowcount
        if gone:
            log.info(
                "deleted %d stored response(s) older than gateway.responses_retention_s (%gs)",
                gone,
                self.retention_s,
            )
        return gone

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response, or None (unknown, another tenant's, or past retention)."""
        with self._lock:
            row = self._db.execute(
                "SELECT id, tenant, created_at, model, response, input_items, history "
                "FROM responses WHERE id = ? AND tenant = ? AND created_at >= ?",
                (response_id, tenant, time.time() - self.retention_s),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(
            id=row[0],
            tenant=row[1],
            created_at=row[2],
            model=row[3],
            response=_object.decode(row[4]),
            input_items=_items.decode(row[5]),
            history=_items.decode(row[6]),
        )

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return (
                self._db.execute(
                    "DELETE FROM responses WHERE id = ? AND tenant = ? AND created_at >= ?",
                    (response_id, tenant, time.time() - self.retention_s),
                ).rowcount
                > 0
            )

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM responses").fetchone()[0])
