"""The node cache's inventory: entries, pins, leases and LRU eviction under a byte cap.

Layout of a cache root (a node-local disk; NVMe in production):

    <root>/<key>/                      a finished entry: the model files as in the source,
                                       read-only, plus .hpcserve-entry.json (its record)
    <root>/.staging-<key>-<nonce>/     a copy in progress, or one left by a dead stager
    <root>/.trash-<key>-<nonce>/       an entry being deleted
    <root>/.locks/<key>.lock           the entry's flock (locks.py); never deleted
    <root>/.leases/<key>/<pid>-<n>.json  one per engine using the entry (leases.py)
    <root>/.pins/<key>                 exists while the entry is pinned

An entry exists exactly when `<root>/<key>/` does, and that directory only ever appears by
an atomic rename of a complete, verified copy, and only ever leaves by a rename to
`.trash-*`; so a crash at any point leaves either a complete entry or none. The last use of
an entry is the mtime of its record, touched by every stage hit and lease.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path

import msgspec

from hpcserve.modelcache.errors import (
    CacheError,
    CacheFullError,
    EntryBusyError,
    NotCachedError,
)
from hpcserve.modelcache.leases import (
    Lease,
    live_leases,
    prune_stale,
    release_lease,
    write_lease,
)
from hpcserve.modelcache.locks import LockTimeout, NodeLock, check_local_filesystem
from hpcserve.modelcache.manifest import (
    DEFAULT_WORKERS,
    RECORD_NAME,
    Manifest,
    Mismatch,
    ProgressSink,
    verify,
)
from hpcserve.modelcache.progress import human_bytes
from hpcserve.modelcache.refs import KEY_RE, check_key

log = logging.getLogger(__name__)


class EntryRecord(msgspec.Struct, frozen=True):
    """What was staged into an entry, from where; written inside it before its rename."""

    name: str
    version: int
    source: str
    manifest: Manifest
    staged_at: float


class CacheEntry(msgspec.Struct, frozen=True):
    key: str
    bytes: int
    last_use: float
    pinned: bool
    leases: int
    record: EntryRecord | None  # None: no readable record, a broken entry


_record_decoder = msgspec.json.Decoder(EntryRecord)
_PARTIAL_RE = re.compile(r"\.(?:staging|trash)-(" + KEY_RE.pattern + r")-[0-9a-f]{8}")


class NodeCache:
    """A cache root on a node-local disk.

    Every change to an entry (stage, lease, pin, evict, discard) happens under the entry's
    NodeLock, so eviction cannot race a stager or an engine taking a lease. Eviction is LRU
    by record mtime and only try-locks: an entry whose lock is busy is being staged or
    leased right now and is skipped, which also means two evictors (or an evictor and a
    stager making room) cannot deadlock.

    Failure modes: a cache root on a network filesystem is refused (flock would not
    exclude); a cap that pinned and in-use entries alone exceed raises CacheFullError
    rather than deleting what a running engine reads.
    """

    def __init__(
        self, root: Path, *, lock_timeout_s: float = 3600.0, check_local: bool = True
    ) -> None:
        self.root = Path(root)
        self.lock_timeout_s = lock_timeout_s
        self.root.mkdir(parents=True, exist_ok=True)
        if check_local:
            check_local_filesystem(self.root)
        for sub in (".locks", ".leases", ".pins"):
            (self.root / sub).mkdir(exist_ok=True)

    # -- paths and records

    def entry_dir(self, key: str) -> Path:
        return self.root / check_key(key)

    def lock(self, key: str) -> NodeLock:
        return NodeLock(self.root / ".locks" / f"{check_key(key)}.lock")

    def entry_keys(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if KEY_RE.fullmatch(p.name))

    def read_record(self, key: str) -> EntryRecord | None:
        try:
            return _record_decoder.decode((self.entry_dir(key) / RECORD_NAME).read_bytes())
        except (OSError, msgspec.DecodeError):
            return None

    def resolve(self, text: str) -> str:
        """A cache key, or `name@version` naming exactly one entry, -> the key."""
        keys = self.entry_keys()
        if text in keys:
            return text
        matches = [k for k in keys if k.startswith(text + "-")]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise CacheError(f"{text!r} names several entries: {', '.join(matches)}")
        raise NotCachedError(f"{text!r} is not in the cache at {self.root}")

    # -- inventory

    def entry(self, key: str) -> CacheEntry:
        path = self.entry_dir(key)
        if not path.is_dir():
            raise NotCachedError(f"{key!r} is not in the cache at {self.root}")
        record = self.read_record(key)
        stamp = path / RECORD_NAME if record else path
        try:
            last_use = stamp.stat().st_mtime
        except FileNotFoundError:
            raise NotCachedError(f"{key!r} left the cache at {self.root}") from None
        size = record.manifest.total_bytes if record else _disk_usage(path)
        return CacheEntry(
            key=key,
            bytes=size,
            last_use=last_use,
            pinned=self.is_pinned(key),
            leases=len(live_leases(self.root, key)),
            record=record,
        )

    def entries(self) -> list[CacheEntry]:
        """Every entry, least recently used first."""
        found = []
        for key in self.entry_keys():
            with contextlib.suppress(NotCachedError, FileNotFoundError):
                found.append(self.entry(key))
        return sorted(found, key=lambda e: (e.last_use, e.key))

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())

    def touch(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.entry_dir(key) / RECORD_NAME)

    # -- pins and leases

    def is_pinned(self, key: str) -> bool:
        return (self.root / ".pins" / key).exists()

    def pin(self, key: str) -> None:
        with self.locked(key):
            self._require(key)
            (self.root / ".pins" / key).touch()

    def unpin(self, key: str) -> None:
        with self.locked(key):
            (self.root / ".pins" / key).unlink(missing_ok=True)

    def lease(self, key: str, pid: int | None = None) -> Lease:
        """Mark `key` as used by process `pid` (default: this one) until `release`."""
        with self.locked(key):
            return self.lease_locked(key, pid)

    def lease_locked(self, key: str, pid: int | None = None) -> Lease:
        self._require(key)
        lease = write_lease(self.root, key, os.getpid() if pid is None else pid)
        self.touch(key)
        return lease

    def release(self, lease: Lease) -> None:
        release_lease(lease)

    # -- eviction and removal

    def evict(self, key: str) -> None:
        """Remove one entry now; refuses a pinned or in-use one, or one being staged."""
        lock = self.lock(key)
        if not lock.try_acquire():
            raise EntryBusyError(f"{key!r} is being staged, verified or leased right now")
        try:
            self._require(key)
            reason = self._keep_reason(key)
            if reason:
                raise EntryBusyError(f"{key!r} is {reason}; not evicted")
            self.discard_locked(key)
        finally:
            lock.release()

    def evict_to(
        self, cap_bytes: int, *, reserve_bytes: int = 0, keep: Collection[str] = ()
    ) -> list[str]:
        """Evict least recently used entries until their bytes plus `reserve_bytes` fit in
        `cap_bytes`; returns the evicted keys, raises CacheFullError if that is impossible.
        Copies left by dead stagers go first, whatever the cap."""
        self.sweep()
        entries = self.entries()
        used = sum(e.bytes for e in entries)
        evicted: list[str] = []
        for e in entries:
            if used + reserve_bytes <= cap_bytes:
                break
            if e.key in keep or e.pinned or e.leases or not self._try_evict(e.key):
                continue
            used -= e.bytes
            evicted.append(e.key)
        if used + reserve_bytes > cap_bytes:
            raise CacheFullError(
                f"cache cap {human_bytes(cap_bytes)} cannot fit {human_bytes(reserve_bytes)} "
                f"more: {human_bytes(used)} remain in entries pinned, in use or being staged"
            )
        return evicted

    def verify(
        self, key: str, *, workers: int = DEFAULT_WORKERS, progress: ProgressSink | None = None
    ) -> list[Mismatch]:
        """Re-hash an entry against its record; a corrupt entry is discarded at once."""
        with self.locked(key):
            return self.verify_locked(key, workers=workers, progress=progress)

    def verify_locked(
        self, key: str, *, workers: int = DEFAULT_WORKERS, progress: ProgressSink | None = None
    ) -> list[Mismatch]:
        self._require(key)
        record = self.read_record(key)
        if record is None:
            problems = [Mismatch(RECORD_NAME, "missing", "an entry record", "none readable")]
        else:
            path = self.entry_dir(key)
            problems = verify(record.manifest, path, workers=workers, progress=progress)
        if problems:
            log.error("cache entry %s is corrupt, discarding it: %s", key, problems[0])
            self.discard_locked(key)
        return problems

    def discard_locked(self, key: str) -> None:
        """Rename the entry out of sight (atomic), then delete it. Caller holds the lock."""
        trash = self.root / f".trash-{key}-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.entry_dir(key), trash)
            shutil.rmtree(trash, ignore_errors=True)

    def sweep(self) -> list[str]:
        """Delete the staging and trash directories of every entry whose lock is free (their
        stager or evictor died); returns their names. A busy lock means a copy in progress."""
        removed: list[str] = []
        partials = {m.group(1) for p in self.root.iterdir() if (m := _PARTIAL_RE.fullmatch(p.name))}
        for key in sorted(partials):
            lock = self.lock(key)
            if lock.try_acquire():
                try:
                    removed += sorted(p.name for p in self._partials(key))
                    self.clean_partials_locked(key)
                finally:
                    lock.release()
        return removed

    def clean_partials_locked(self, key: str) -> int:
        """Delete staging and trash directories of `key` left by a dead process."""
        stale = self._partials(key)
        for path in stale:
            log.info("removing %s, left by an interrupted stage or eviction", path.name)
            shutil.rmtree(path, ignore_errors=True)
        return len(stale)

    # -- helpers

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Hold the entry's lock, waiting at most `lock_timeout_s`."""
        lock = self.lock(key)
        try:
            lock.acquire(self.lock_timeout_s)
        except LockTimeout as err:
            raise LockTimeout(f"{err}; raise NodeCache lock_timeout_s to wait longer") from None
        try:
            yield
        finally:
            lock.release()

    def _partials(self, key: str) -> list[Path]:
        return [*self.root.glob(f".staging-{key}-*"), *self.root.glob(f".trash-{key}-*")]

    def _require(self, key: str) -> None:
        if not self.entry_dir(key).is_dir():
            raise NotCachedError(f"{key!r} is not in the cache at {self.root}")

    def _keep_reason(self, key: str) -> str | None:
        if self.is_pinned(key):
            return "pinned"
        live = prune_stale(self.root, key)
        if live:
            return "in use by " + ", ".join(lease.owner.describe() for lease in live)
        return None

    def _try_evict(self, key: str) -> bool:
        lock = self.lock(key)
        if not lock.try_acquire():
            return False
        try:
            if not self.entry_dir(key).is_dir():
                return True  # someone else removed it: its bytes are free all the same
            if self._keep_reason(key):
                return False
            log.info("evicting %s (least recently used)", key)
            self.discard_locked(key)
            return True
        finally:
            lock.release()


def _disk_usage(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
