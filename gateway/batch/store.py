"""Durable state of the Batch API: SQLite for records, a directory for file contents.

Layout under the batch directory (`batch.dir`, default ``<state_dir>/batch``):
``batch.sqlite3`` (WAL, synchronous=FULL: a commit is on disk when it returns) and
``files/<file id>`` (written to a temporary name, fsync'd, renamed, directory fsync'd,
and only then recorded). A request's result is counted only in the transaction that
stores it, keyed by (batch, line), so a result can be stored once and only once: after a
crash the runner redoes just the lines without a stored result.

The store is synchronous and thread-safe (one connection, one lock); the async code calls
it through `asyncio.to_thread`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from hpcserve.contracts.batch_backlog import FileSummary
from hpcserve.contracts.private_files import private_dir, private_opener
from hpcserve.gateway.batch.validate import split_lines
from hpcserve.gateway.sqlite_wal import connect_wal

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("failed", "completed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    summary BLOB
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    output_file_id TEXT,
    error_file_id TEXT,
    errors BLOB,
    metadata BLOB,
    model TEXT,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    status_code INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    body BLOB,
    error_code TEXT,
    error_message TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""


class FileRecord(msgspec.Struct, frozen=True):
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    summary: FileSummary | None = None


class BatchError(msgspec.Struct, frozen=True):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchRecord(msgspec.Struct, frozen=True):
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    total: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[BatchError] | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class Result(msgspec.Struct, frozen=True):
    """The outcome of one input line: an HTTP answer from an engine, or an error without one."""

    line: int
    custom_id: str
    status_code: int  # 0: no response (error_code says why)
    request_id: str
    body: bytes | None = None
    error_code: str | None = None
    error_message: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def succeeded(self) -> bool:
        return 200 <= self.status_code < 300


class Page(msgspec.Struct, frozen=True):
    items: list[Any]
    has_more: bool


class NotFound(LookupError):
    pass


class Conflict(RuntimeError):
    pass


_summary = msgspec.json.Decoder(FileSummary)
_errors = msgspec.json.Decoder(list[BatchError])
_metadata = msgspec.json.Decoder(dict[str, str])
_encode = msgspec.json.encode
_BATCH_FIELDS = tuple(BatchRecord.__struct_fields__)
_FILE_FIELDS = tuple(FileRecord.__struct_fields__)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files_dir = root / "files"
        # Tenants' requests and results: owner-only (contracts/private_files.py).
        private_dir(root)
        private_dir(self.files_dir)
        self._lock = threading.Lock()
        self._db = connect_wal(root / "batch.sqlite3")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- files -------------------------------------------------------------------------

    def _page(
        self,
        table: str,
        fields: tuple[str, ...],
        filters: dict[str, object],
        after: str | None,
        limit: int,
        newest_first: bool,
    ) -> list[tuple[Any, ...]]:
        """Up to limit + 1 rows of `table` (the extra one says there is more), in creation
        order, those after the row `after` only, where each non-None filter column equals
        its value."""
        where = ["1 = 1"]
        args: list[object] = []
        for column, value in filters.items():
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if after:
            where.append(
                f"seq {'<' if newest_first else '>'} (SELECT seq FROM {table} WHERE id = ?)"
            )
            args.append(after)
        return self._query(
            f"SELECT {', '.join(fields)} FROM {table} WHERE {' AND '.join(where)} "
            f"ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?",
            (*args, limit + 1),
        )

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def temp_path(self) -> Path:
        return self.files_dir / f".upload-{secrets.token_hex(8)}"

    def add_file(
        self,
        temp: Path,
        *,
        tenant: str,
        filename: str,
        purpose: str,
        summary: FileSummary | None,
        file_id: str | None = None,
    ) -> FileRecord:
        """Make a written, closed temporary file durable and record it."""
        record = FileRecord(
            id=file_id or new_id("file-"),
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            bytes=temp.stat().st_size,
            created_at=int(time.time()),
            summary=summary,
        )
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, self.path_of(record.id))
        _fsync_dir(self.files_dir)
        with self._transaction() as db:
            self._insert_file(db, record)
        return record

    @staticmethod
    def _insert_file(db: sqlite3.Connection, record: FileRecord) -> None:
        db.execute(
            "INSERT OR REPLACE INTO files (id, tenant, filename, purpose, bytes, created_at, "
            "summary) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record.id,
                record.tenant,
                record.filename,
                record.purpose,
                record.bytes,
                record.created_at,
                _encode(record.summary) if record.summary is not None else None,
            ),
        )

    @staticmethod
    def _file_from_row(row: tuple[Any, ...]) -> FileRecord:
        values = dict(zip(_FILE_FIELDS, row, strict=True))
        summary = values.pop("summary")
        return FileRecord(**values, summary=_summary.decode(summary) if summary else None)

    def get_file(self, file_id: str, tenant: str | None) -> FileRecord:
        """The file, if `tenant` may see it (None: any tenant, the admin)."""
        rows = self._query(f"SELECT {', '.join(_FILE_FIELDS)} FROM files WHERE id = ?", (file_id,))
        if not rows or (tenant is not None and rows[0][1] != tenant):
            raise NotFound(f"No such file: {file_id}")
        return self._file_from_row(rows[0])

    def list_files(
        self,
        tenant: str | None,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        newest_first: bool = True,
    ) -> Page:
        filters: dict[str, object] = {"tenant": tenant, "purpose": purpose or None}
        rows = self._page("files", _FILE_FIELDS, filters, after, limit, newest_first)
        return Page([self._file_from_row(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def delete_file(self, file_id: str, tenant: str | None) -> None:
        self.get_file(file_id, tenant)
        with self._transaction() as db:
            busy = db.execute(
                "SELECT id, status FROM batches WHERE input_file_id = ? AND status IN "
                f"({', '.join('?' * len(ACTIVE))}) LIMIT 1",
                (file_id, *ACTIVE),
            ).fetchall()
            if busy:
                raise Conflict(
                    f"File {file_id} is the input of batch {busy[0][0]}, which is "
                    f"{busy[0][1]}; cancel it or wait for it to end first"
                )
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.path_of(file_id).unlink(missing_ok=True)

    def input_lines(self, file_id: str) -> Generator[tuple[int, bytes]]:
        with open(self.path_of(file_id), "rb") as f:
            yield from split_lines(iter(lambda: f.read(1 << 20), b""))

    # -- batches -----------------------------------------------------------------------

    def create_batch(self, record: BatchRecord) -> BatchRecord:
        with self._transaction() as db:
            self._write_batch(db, record, insert=True)
        return record

    @staticmethod
    def _write_batch(db: sqlite3.Connection, record: BatchRecord, *, insert: bool) -> None:
        values = [getattr(record, f) for f in _BATCH_FIELDS]
        values[_BATCH_FIELDS.index("errors")] = (
            _encode(record.errors) if record.errors is not None else None
        )
        values[_BATCH_FIELDS.index("metadata")] = (
            _encode(record.metadata) if record.metadata is not None else None
        )
        if insert:
            db.execute(
                f"INSERT INTO batches ({', '.join(_BATCH_FIELDS)}) "
                f"VALUES ({', '.join('?' * len(_BATCH_FIELDS))})",
                values,
            )
        else:
            db.execute(
                f"UPDATE batches SET {', '.join(f'{f} = ?' for f in _BATCH_FIELDS[1:])} "
                "WHERE id = ?",
                (*values[1:], record.id),
            )

    @staticmethod
    def _batch_from_row(row: tuple[Any, ...]) -> BatchRecord:
        values = dict(zip(_BATCH_FIELDS, row, strict=True))
        if values["errors"] is not None:
            values["errors"] = _errors.decode(values["errors"])
        if values["metadata"] is not None:
            values["metadata"] = _metadata.decode(values["metadata"])
        return BatchRecord(**values)

    def get_batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord:
        rows = self._query(
            f"SELECT {', '.join(_BATCH_FIELDS)} FROM batches WHERE id = ?", (batch_id,)
        )
        if not rows or (tenant is not None and rows[0][1] != tenant):
            raise NotFound(f"No such batch: {batch_id}")
        return self._batch_from_row(rows[0])

    def list_batches(
        self, tenant: str | None, *, after: str | None = None, limit: int = 20
    ) -> Page:
        rows = self._page("batches", _BATCH_FIELDS, {"tenant": tenant}, after, limit, True)
        return Page([self._batch_from_row(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def active_batches(self) -> list[BatchRecord]:
        rows = self._query(
            f"SELECT {', '.join(_BATCH_FIELDS)} FROM batches WHERE status IN "
            f"({', '.join('?' * len(ACTIVE))}) ORDER BY seq",
            ACTIVE,
        )
        return [self._batch_from_row(r) for r in rows]

    def update_batch(self, batch_id: str, **changes: object) -> BatchRecord:
        """Apply field changes in one transaction; counts stay as the results made them."""
        with self._transaction() as db:
            row = db.execute(
                f"SELECT {', '.join(_BATCH_FIELDS)} FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
            if row is None:
                raise NotFound(f"No such batch: {batch_id}")
            record = msgspec.structs.replace(self._batch_from_row(row), **changes)
            self._write_batch(db, record, insert=False)
        return record

    def request_cancel(self, batch_id: str, tenant: str | None) -> BatchRecord:
        with self._transaction() as db:
            row = db.execute(
                f"SELECT {', '.join(_BATCH_FIELDS)} FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
            if row is None or (tenant is not None and row[1] != tenant):
                raise NotFound(f"No such batch: {batch_id}")
            record = self._batch_from_row(row)
            if record.status in ("cancelling", "cancelled"):
                return record
            if record.status not in ("validating", "in_progress"):
                raise Conflict(f"Cannot cancel a batch with status '{record.status}'")
            record = msgspec.structs.replace(
                record, status="cancelling", cancelling_at=int(time.time())
            )
            self._write_batch(db, record, insert=False)
        return record

    # -- results -----------------------------------------------------------------------

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self._query("SELECT line FROM results WHERE batch_id = ?", (batch_id,))
        return {r[0] for r in rows}

    def record_results(self, batch_id: str, results: list[Result]) -> int:
        """Store results and count them, in one transaction; a line stored before is skipped
        (and not counted twice). Returns how many were new."""
        completed = failed = input_tokens = output_tokens = 0
        with self._transaction() as db:
            for r in results:
                cursor = db.execute(
                    "INSERT OR IGNORE INTO results (batch_id, line, custom_id, status_code, "
                    "request_id, body, error_code, error_message, input_tokens, output_tokens) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        batch_id,
                        r.line,
                        r.custom_id,
                        r.status_code,
                        r.request_id,
                        r.body,
                        r.error_code,
                        r.error_message,
                        r.input_tokens,
                        r.output_tokens,
                    ),
                )
                if cursor.rowcount != 1:
                    continue
                if r.succeeded:
                    completed += 1
                else:
                    failed += 1
                input_tokens += r.input_tokens
                output_tokens += r.output_tokens
            db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                "input_tokens = input_tokens + ?, output_tokens = output_tokens + ? "
                "WHERE id = ?",
                (completed, failed, input_tokens, output_tokens, batch_id),
            )
        return completed + failed

    def results(self, batch_id: str) -> Iterator[Result]:
        """Every stored result of a batch in line order, read in pages."""
        last = 0
        fields = tuple(Result.__struct_fields__)
        while True:
            rows = self._query(
                f"SELECT {', '.join(fields)} FROM results WHERE batch_id = ? AND line > ? "
                "ORDER BY line LIMIT 1000",
                (batch_id, last),
            )
            if not rows:
                return
            for row in rows:
                yield Result(*row)
            last = rows[-1][0]

    # -- the end of a batch ------------------------------------------------------------

    def finish(
        self,
        batch: BatchRecord,
        *,
        status: str,
        unfinished_code: str | None,
        unfinished_message: str = "",
    ) -> BatchRecord:
        """Write the output and error files from the stored results (and, with
        unfinished_code, an error line per line that never ran), then record the files and
        the final status in one transaction. Safe to repeat after a crash: the file ids are
        the batch's own."""
        suffix = batch.id.removeprefix("batch_")
        output_id, error_id = f"file-out-{suffix}", f"file-err-{suffix}"
        out_temp, err_temp = self.temp_path(), self.temp_path()
        done: set[int] = set()
        wrote_out = wrote_err = False
        with (
            open(out_temp, "wb", opener=private_opener) as out,
            open(err_temp, "wb", opener=private_opener) as err,
        ):
            for result in self.results(batch.id):
                done.add(result.line)
                if result.succeeded:
                    _write_line(out, _output_line(result))
                    wrote_out = True
                else:
                    _write_line(err, _output_line(result))
                    wrote_err = True
            if unfinished_code is not None:
                for number, raw in self.input_lines(batch.input_file_id):
                    if number in done:
                        continue
                    custom_id = _custom_id_of(raw)
                    _write_line(
                        err,
                        _encode(
                            {
                                "id": f"batch_req_{secrets.token_hex(12)}",
                                "custom_id": custom_id,
                                "response": None,
                                "error": {"code": unfinished_code, "message": unfinished_message},
                            }
                        ),
                    )
                    wrote_err = True
        records: list[FileRecord] = []
        for temp, file_id, wrote, name in (
            (out_temp, output_id, wrote_out, "output"),
            (err_temp, error_id, wrote_err, "errors"),
        ):
            if not wrote:
                temp.unlink()
                continue
            with open(temp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(temp, self.path_of(file_id))
            records.append(
                FileRecord(
                    id=file_id,
                    tenant=batch.tenant,
                    filename=f"{batch.id}_{name}.jsonl",
                    purpose="batch_output",
                    bytes=self.path_of(file_id).stat().st_size,
                    created_at=int(time.time()),
                )
            )
        _fsync_dir(self.files_dir)
        now = int(time.time())
        stamp = {
            "completed": "completed_at",
            "expired": "expired_at",
            "cancelled": "cancelled_at",
            "failed": "failed_at",
        }[status]
        with self._transaction() as db:
            for record in records:
                self._insert_file(db, record)
            row = db.execute(
                f"SELECT {', '.join(_BATCH_FIELDS)} FROM batches WHERE id = ?", (batch.id,)
            ).fetchone()
            final = msgspec.structs.replace(
                self._batch_from_row(row),
                status=status,
                output_file_id=output_id if wrote_out else None,
                error_file_id=error_id if wrote_err else None,
                **{stamp: now},
            )
            self._write_batch(db, final, insert=False)
        return final


def _write_line(f: IO[bytes], line: bytes) -> None:
    f.write(line)
    f.write(b"\n")


class _CustomId(msgspec.Struct):
    custom_id: str = ""


_custom_id = msgspec.json.Decoder(_CustomId)


def _custom_id_of(raw: bytes) -> str:
    return _custom_id.decode(raw).custom_id


def _output_line(result: Result) -> bytes:
    response = None
    if result.status_code:
        body = result.body or b"null"
        response = {
            "status_code": result.status_code,
            "request_id": result.request_id,
            "body": msgspec.Raw(body),
        }
    error = None
    if result.error_code is not None:
        error = {"code": result.error_code, "message": result.error_message or ""}
    return _encode(
        {
            "id": f"batch_req_{result.request_id.removeprefix('req_')}",
            "custom_id": result.custom_id,
            "response": response,
            "error": error,
        }
    )
