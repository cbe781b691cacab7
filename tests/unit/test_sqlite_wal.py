"""Several processes opening one state dir's databases at the same moment (gateways on one
host, a gateway's workers, the batch runner) all start: SQLite refuses a concurrent switch to
WAL at once, without its busy timeout (gateway/sqlite_wal.py)."""

from __future__ import annotations

import multiprocessing
import sqlite3
import stat
import traceback
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest

from hpcserve.gateway.batch.store import BatchStore
from hpcserve.gateway.responses_store import ResponseStore
from hpcserve.gateway.sqlite_wal import connect_wal

PROCESSES = 6
ROUNDS = 24


def _open_stores(root: str, barrier: Barrier, errors: Any) -> None:
    try:
        barrier.wait()
        BatchStore(Path(root) / "batch").close()
        ResponseStore(Path(root) / "responses", 60).close()
    except BaseException:
        errors.put(traceback.format_exc())


def test_stores_opened_by_processes_at_once_all_open(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for round_ in range(ROUNDS):
        root = tmp_path / str(round_)
        barrier = ctx.Barrier(PROCESSES)
        procs = [
            ctx.Process(target=_open_stores, args=(str(root), barrier, errors))
            for _ in range(PROCESSES)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(60)
        assert [proc.exitcode for proc in procs] == [0] * PROCESSES
        assert errors.empty(), errors.get()
        for db in (root / "batch" / "batch.sqlite3", root / "responses" / "responses.sqlite3"):
            with sqlite3.connect(db) as check:
                assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_connect_wal_sets_the_file_private_and_its_pragmas(tmp_path: Path) -> None:
    db = connect_wal(tmp_path / "a.sqlite3")
    try:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
        assert db.execute("PRAGMA busy_timeout").fetchone() == (5000,)
    finally:
        db.close()
    assert stat.S_IMODE((tmp_path / "a.sqlite3").stat().st_mode) == 0o600


def test_connect_wal_gives_up_past_the_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "held.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            connect_wal(path, busy_timeout_s=0.2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert connect_wal(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)
