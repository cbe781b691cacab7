"""The Batch API's backlog per model, read from the batch store by another process.

What waits is every line of a `validating` or `in_progress` batch without a committed result
(`total - completed - failed`; lines in flight count until their result is stored). A batch
whose file names several models counts its lines against each of them. The store is one
SQLite database under `batch.dir` shared by every gateway, so one read sees the backlog of
all of them. Opened read-only per call: the reader never writes, never creates the
database, and holds no lock between calls.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec


class FileSummary(msgspec.Struct, frozen=True):
    """What the batch runner needs to know about a valid file without reading it again."""

    lines: int
    urls: list[str]
    models: list[str]


DATABASE = "batch.sqlite3"
_summary = msgspec.json.Decoder(FileSummary)

_QUERY = """
SELECT b.model, b.total - b.completed - b.failed, f.summary
FROM batches b LEFT JOIN files f ON f.id = b.input_file_id
WHERE b.status IN ('validating', 'in_progress')
"""


class BacklogReadError(RuntimeError):
    pass


def read_backlog(batch_dir: Path) -> dict[str, int]:
    """Model -> Batch API requests not yet answered; {} when there is no store yet."""
    path = Path(batch_dir) / DATABASE
    if not path.exists():
        return {}
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = db.execute(_QUERY).fetchall()
        finally:
            db.close()
    except sqlite3.Error as err:
        raise BacklogReadError(f"cannot read the batch store {path}: {err}") from err
    return backlog_from_rows(rows)


def backlog_from_rows(rows: list[tuple[str | None, int, bytes | None]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for model, left, summary in rows:
        if left <= 0:
            continue
        models = [model] if model else (_summary.decode(summary).models if summary else [])
        for name in models:
            out[name] = out.get(name, 0) + left
    return out
