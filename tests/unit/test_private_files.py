"""At rest, owner-only whatever the umask: the state dir, batch files and database, the model
registry, audit log; paths made looser by someone else are tightened (logged once)."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcserve.contracts.private_files import (
    open_private_append,
    private_dir,
    private_file,
    tighten,
    write_private,
)
from hpcserve.gateway.batch.store import BatchStore
from hpcserve.modelcache.registry import Registry


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def permissive_umask() -> Iterator[None]:
    """A site's usual umask (022): anything not made owner-only on purpose is world-readable."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_dirs_and_files_are_made_owner_only(tmp_path: Path) -> None:
    state = private_dir(tmp_path / "a" / "state")
    assert mode(state) == 0o700
    assert mode(private_file(state / "db")) == 0o600
    assert mode(write_private(state / "key", b"k\n")) == 0o600
    os.close(open_private_append(state / "audit.log"))
    assert mode(state / "audit.log") == 0o600
    assert sorted(p.name for p in state.iterdir()) == ["audit.log", "db", "key"]


def test_existing_loose_paths_are_tightened_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / "db").write_text("x")
    os.chmod(state / "db", 0o664)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            private_dir(state)
            private_file(state / "db")
            os.chmod(state / "db", 0o644)  # loosened again: fixed again, not logged again
    assert mode(state) == 0o700 and (state / "db").read_text() == "x"
    assert [r.getMessage() for r in caplog.records] == [
        f"{state} was mode 0755: now 0700 (owner only)",
        f"{state / 'db'} was mode 0664: now 0600 (owner only)",
    ]


def test_the_batch_store_keeps_tenants_files_and_results_owner_only(tmp_path: Path) -> None:
    root = tmp_path / "batch"
    store = BatchStore(root)
    try:
        assert mode(root) == 0o700 and mode(root / "files") == 0o700
        # SQLite gives its WAL and shared-memory files the database file's mode.
        made = {p.name: mode(p) for p in root.glob("batch.sqlite3*")}
        assert made == {f"batch.sqlite3{s}": 0o600 for s in ("", "-wal", "-shm")}
    finally:
        store.close()


def test_the_model_registry_database_is_owner_only_even_when_it_was_not(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite3"
    Registry(path).close()
    assert mode(path) == 0o600
    os.chmod(path, 0o644)
    Registry(path).close()
    assert mode(path) == 0o600


def test_only_files_and_directories_are_tightened(tmp_path: Path) -> None:
    """A special file given as a destination (a FIFO here, /dev/null at a site) keeps its
    mode: it is shared with everyone by design."""
    os.mkfifo(tmp_path / "pipe")
    os.chmod(tmp_path / "pipe", 0o666)
    tighten(tmp_path / "pipe")
    assert mode(tmp_path / "pipe") == 0o666


def test_the_demo_key_config_and_curve_keys_of_hpcserve_up_are_owner_only(tmp_path: Path) -> None:
    from hpcserve.stack import Stack

    stack = Stack(tmp_path / "state")
    private_dir(stack.state_dir)
    config = stack._ensure_config("local")  # what `up` writes before it starts anything
    state = stack.state_dir
    assert mode(state) == 0o700
    assert mode(state / "demo-api-key") == 0o600 and mode(state / "hpcserve.toml") == 0o600
    curve = Path(config.router.curve_dir)
    secrets = sorted(curve.glob("*.key_secret"))
    assert secrets and all(mode(p) == 0o600 for p in secrets) and mode(curve) == 0o700
