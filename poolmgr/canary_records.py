"""The golden records (numerical canaries, contracts/canary.py) as files the engines read.

Jobs do not reach the registry (SQLite on the control node); like a version's manifest,
its golden record travels as a file under the state directory, which the nodes share:
`<state_dir>/canaries/<name>@<version>.json`. Every job of a registry version gets that
path (`$HPCSERVE_CANARY_RECORD`) whether or not the version has a record yet. The pool
manager writes the file when it submits a job, and every `every_s` brings the files of
the versions its live replicas serve in step with the registry (written when the record
changed, removed when it was cleared), so a record made while replicas serve reaches
their health monitors, which then check at once (health/canary.py).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from hpcserve.contracts.canary import encode_record
from hpcserve.modelcache.registry import Registry, RegistryError
from hpcserve.poolmgr.state_files import write_atomic

log = logging.getLogger(__name__)


def record_path(state_dir: str | Path, ref: str) -> Path:
    return Path(state_dir) / "canaries" / f"{ref}.json"


def write_record_file(registry: Registry, state_dir: str | Path, ref: str) -> Path:
    """Bring version `ref`'s record file in step with the registry; returns its path."""
    path = record_path(state_dir, ref)
    record = registry.canary_record(ref)
    try:
        current = path.read_bytes()
    except FileNotFoundError:
        current = None
    if record is None:
        if current is not None:
            path.unlink(missing_ok=True)
            log.info("golden record of %s cleared: removed %s", ref, path)
        return path
    data = encode_record(record)
    if data != current:
        write_atomic(path, data)
        log.info("golden record of %s written to %s for its replicas", ref, path)
    return path


class CanaryRecords:
    def __init__(self, state_dir: str | Path, registry_path: str, every_s: float = 30.0) -> None:
        self.state_dir = Path(state_dir)
        self.registry_path = Path(registry_path)
        self.every_s = every_s
        self._last: float | None = None

    def sync(self, refs: Iterable[str], now: float) -> None:
        """The record files of `refs` (versions live replicas serve), every `every_s`."""
        wanted = sorted(set(refs))
        if not wanted or (self._last is not None and now - self._last < self.every_s):
            return
        if not self.registry_path.exists():
            return
        self._last = now
        try:
            with Registry(self.registry_path) as registry:
                for ref in wanted:
                    try:
                        write_record_file(registry, self.state_dir, ref)
                    except RegistryError as err:  # removed meanwhile
                        log.warning("golden record of %s: %s", ref, err)
        except (RegistryError, OSError, sqlite3.Error) as err:
            log.warning("cannot sync the golden records from %s: %s", self.registry_path, err)
