"""Stage a model from its source (a shared filesystem) into the node cache, verified.

`stage` holds the entry's node-local lock from the first look to the final rename, so a
second job on the node staging the same model waits, then finds the finished entry.
Under the lock: a present entry is verified (a corrupt one is discarded and staged again,
never served); partial copies of dead stagers are deleted; room is made under the cap;
`ChunkCopier` copies into `.staging-<key>-<nonce>/` checking every file's digest; the
record is written; one rename publishes the entry.

Crash safety: a process that dies mid-copy (SIGKILL, OOM, scancel) leaves only a
`.staging-*` directory, which the next stager deletes; the rename is the commit. fsync is
about power loss only, and by default it is skipped when hits are verified: a torn entry
after a power cut fails the digest check of the next hit and is staged again, so the
fsync would buy nothing but time. With `verify_hit=False` (sizes only) every file and
directory is fsynced before the rename.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from hpcserve.modelcache.cache import EntryRecord, NodeCache
from hpcserve.modelcache.copier import COPY_CHUNK_BYTES, ChunkCopier
from hpcserve.modelcache.manifest import (
    DEFAULT_WORKERS,
    RECORD_NAME,
    Manifest,
    ProgressSink,
    check_manifest,
    verify,
)
from hpcserve.modelcache.refs import cache_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Staged:
    path: Path  # what vLLM loads
    key: str
    copied: bool  # False: the entry was already there (and verified)
    bytes: int
    seconds: float


def stage(
    manifest: Manifest,
    source_dir: Path,
    cache: NodeCache,
    *,
    name: str,
    version: int,
    progress: ProgressSink | None = None,
    workers: int = DEFAULT_WORKERS,
    chunk_bytes: int = COPY_CHUNK_BYTES,
    verify_hit: bool = True,
    cap_bytes: int | None = None,
    lease_pid: int | None = None,
    durable: bool | None = None,
) -> Staged:
    """Make `name@version` (bytes described by `manifest`) present and verified in `cache`.

    `verify_hit` re-hashes an entry that is already there (False: sizes only); the reads
    also warm the page cache vLLM then loads from. `cap_bytes` evicts least recently used
    entries first. `lease_pid` takes a lease for that process before the lock is released,
    so no eviction slips in between staging and use. `durable` (fsync before the rename)
    defaults to `not verify_hit`. `progress` counts the bytes verified on a hit and the
    bytes copied otherwise (both, after a corrupt hit).
    """
    check_manifest(manifest)
    durable = not verify_hit if durable is None else durable
    key = cache_key(name, version, manifest.digest())
    started = time.monotonic()
    with cache.locked(key):
        copied = not _usable_hit(cache, key, manifest, verify_hit, workers, progress)
        if copied:
            cache.clean_partials_locked(key)
            if cap_bytes is not None:
                cache.evict_to(cap_bytes, reserve_bytes=manifest.total_bytes, keep={key})
            record = EntryRecord(name, version, str(source_dir), manifest, time.time())
            copier = ChunkCopier(manifest, source_dir, workers, chunk_bytes, progress, durable)
            _publish(cache, key, record, copier, durable)
        if lease_pid is not None:
            cache.lease_locked(key, lease_pid)
        cache.touch(key)
    seconds = time.monotonic() - started
    log.info("%s %s in %.1fs", "staged" if copied else "cache hit for", key, seconds)
    return Staged(cache.entry_dir(key), key, copied, manifest.total_bytes, seconds)


def _usable_hit(
    cache: NodeCache,
    key: str,
    manifest: Manifest,
    full: bool,
    workers: int,
    progress: ProgressSink | None,
) -> bool:
    path = cache.entry_dir(key)
    if not path.is_dir():
        return False
    record = cache.read_record(key)
    if record is None or record.manifest != manifest:
        problems: list[object] = ["its record is missing or describes other bytes"]
    else:
        mismatches = verify(manifest, path, sizes_only=not full, workers=workers, progress=progress)
        problems = [*mismatches]
    if problems:
        log.error("cache entry %s is corrupt (%s); staging it again", key, problems[0])
        cache.discard_locked(key)
        return False
    return True


def _publish(
    cache: NodeCache, key: str, record: EntryRecord, copier: ChunkCopier, durable: bool
) -> None:
    """Copy into a fresh staging directory, then rename it into place; delete it on error."""
    tmp = cache.root / f".staging-{key}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        copier.run(tmp)
        _write_record(tmp / RECORD_NAME, record, durable)
        if durable:
            _fsync_tree(tmp)
        os.rename(tmp, cache.entry_dir(key))
        if durable:
            _fsync_dir(cache.root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_record(path: Path, record: EntryRecord, durable: bool) -> None:
    with open(path, "xb") as f:
        f.write(msgspec.json.encode(record))
        f.flush()
        if durable:
            os.fsync(f.fileno())
    path.chmod(0o444)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
