"""The cache inventory: LRU eviction under a cap, pins, leases and stale leases."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from hpcserve.modelcache.cache import NodeCache
from hpcserve.modelcache.errors import CacheFullError, EntryBusyError, NotCachedError
from hpcserve.modelcache.leases import lease_dir, read_leases
from hpcserve.modelcache.locks import LockTimeout
from hpcserve.modelcache.manifest import RECORD_NAME, Manifest, build_manifest
from hpcserve.modelcache.procs import Owner, process_start_time
from hpcserve.modelcache.stage import stage
from tests.unit.modelcache_util import CHUNK, make_model


@pytest.fixture
def cache_with_four(tmp_path: Path) -> tuple[NodeCache, dict[str, str], Manifest, Path]:
    """Entries a..d of the same ~5.6 MB model, last used in that order."""
    src = make_model(tmp_path / "src")
    manifest = build_manifest(src, chunk_bytes=CHUNK)
    cache = NodeCache(tmp_path / "cache")
    keys = {}
    for i, name in enumerate("abcd"):
        key = stage(manifest, src, cache, name=name, version=1, chunk_bytes=CHUNK).key
        os.utime(cache.entry_dir(key) / RECORD_NAME, (1000.0 + i, 1000.0 + i))
        keys[name] = key
    return cache, keys, manifest, src


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_ls_lists_entries_least_recently_used_first(cache_with_four) -> None:
    cache, keys, manifest, _ = cache_with_four
    entries = cache.entries()
    assert [e.key for e in entries] == [keys[n] for n in "abcd"]
    assert {e.bytes for e in entries} == {manifest.total_bytes}
    assert cache.total_bytes() == 4 * manifest.total_bytes
    assert cache.resolve("c@1") == keys["c"] and cache.resolve(keys["c"]) == keys["c"]
    with pytest.raises(NotCachedError, match="'zz@1' is not in the cache"):
        cache.resolve("zz@1")


def test_lru_eviction_under_a_cap_skips_pinned_and_in_use(cache_with_four) -> None:
    cache, keys, manifest, _ = cache_with_four
    size = manifest.total_bytes
    cache.pin(keys["a"])
    lease = cache.lease(keys["b"])  # this process: alive
    evicted = cache.evict_to(2 * size)
    assert evicted == [keys["c"], keys["d"]]
    assert cache.entry_keys() == [keys["a"], keys["b"]]
    with pytest.raises(CacheFullError, match="pinned, in use or being staged"):
        cache.evict_to(size)
    cache.release(lease)
    assert cache.evict_to(size) == [keys["b"]]
    cache.unpin(keys["a"])
    assert cache.evict_to(0) == [keys["a"]] and cache.entry_keys() == []


def test_evict_to_uses_lru_order_and_counts_reserved_bytes(cache_with_four) -> None:
    cache, keys, manifest, _ = cache_with_four
    cache.touch(keys["a"])  # a becomes the most recent
    assert cache.evict_to(4 * manifest.total_bytes, reserve_bytes=1) == [keys["b"]]


def test_stage_makes_room_under_its_cap(cache_with_four, tmp_path) -> None:
    cache, keys, manifest, src = cache_with_four
    staged = stage(manifest, src, cache, name="e", version=1, chunk_bytes=CHUNK,
                   cap_bytes=3 * manifest.total_bytes)  # fmt: skip
    assert cache.entry_keys() == sorted([keys["c"], keys["d"], staged.key])


def test_evict_refuses_pinned_in_use_and_locked_entries(cache_with_four) -> None:
    cache, keys, _, _ = cache_with_four
    cache.pin(keys["a"])
    with pytest.raises(EntryBusyError, match="is pinned"):
        cache.evict(keys["a"])
    cache.lease(keys["b"])
    with pytest.raises(EntryBusyError, match=f"in use by pid {os.getpid()}"):
        cache.evict(keys["b"])
    lock = cache.lock(keys["c"])
    assert lock.try_acquire()
    try:
        with pytest.raises(EntryBusyError, match="being staged"):
            cache.evict(keys["c"])
        with pytest.raises(CacheFullError):
            cache.evict_to(0, keep={keys["a"], keys["b"], keys["d"]})  # c is locked: skipped
    finally:
        lock.release()
    cache.evict(keys["c"])
    with pytest.raises(NotCachedError):
        cache.evict(keys["c"])
    with pytest.raises(NotCachedError):
        cache.pin(keys["c"])


def test_stale_leases_are_ignored_and_pruned(cache_with_four) -> None:
    cache, keys, _, _ = cache_with_four
    key = keys["a"]
    cache.lease(key, pid=dead_pid())
    reused = Owner(os.getpid(), socket.gethostname(), (process_start_time(os.getpid()) or 0) - 1)
    (lease_dir(cache.root, key) / "reused-pid.json").write_bytes(msgspec.json.encode(reused))
    (lease_dir(cache.root, key) / "garbage.json").write_text("{not json")
    assert len(read_leases(cache.root, key)) == 3
    assert cache.entry(key).leases == 0  # a dead pid, a reused pid, an unreadable file
    cache.evict(key)
    assert list(lease_dir(cache.root, key).iterdir()) == []


def test_verify_discards_a_corrupt_entry(cache_with_four) -> None:
    cache, keys, _, _ = cache_with_four
    assert cache.verify(keys["a"]) == []
    shard = cache.entry_dir(keys["a"]) / "tokenizer" / "tokenizer.json"
    shard.chmod(0o644)
    shard.write_bytes(b"x" * shard.stat().st_size)
    problems = cache.verify(keys["a"])
    assert [(p.path, p.problem) for p in problems] == [("tokenizer/tokenizer.json", "digest")]
    assert keys["a"] not in cache.entry_keys()
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".trash")]


def test_an_entry_without_a_record_is_listed_and_evictable(cache_with_four) -> None:
    cache, keys, _, _ = cache_with_four
    record = cache.entry_dir(keys["d"]) / RECORD_NAME
    record.unlink()
    entry = cache.entry(keys["d"])
    assert entry.record is None and entry.bytes > 5_000_000
    assert cache.verify(keys["d"])[0].path == RECORD_NAME
    assert keys["d"] not in cache.entry_keys()


def test_sweep_removes_copies_of_dead_stagers_but_not_one_in_progress(cache_with_four) -> None:
    cache, keys, _, _ = cache_with_four
    dead = cache.root / f".staging-x@1-{'a' * 12}-0badf00d"
    busy = cache.root / f".staging-y@1-{'b' * 12}-12345678"
    trash = cache.root / f".trash-{keys['a']}-deadbeef"
    for d in (dead, busy, trash):
        d.mkdir()
        (d / "half.safetensors").write_bytes(b"\0" * 100)
    (cache.root / ".staging-not-a-key").mkdir()
    lock = cache.lock(f"y@1-{'b' * 12}")
    assert lock.try_acquire()
    try:
        assert cache.evict_to(10**12) == []  # evict_to sweeps first
    finally:
        lock.release()
    left = sorted(p.name for p in cache.root.iterdir() if p.name.startswith("."))
    assert left == [".leases", ".locks", ".pins", ".staging-not-a-key", busy.name]
    assert cache.sweep() == [busy.name]


def test_a_stager_that_waits_too_long_names_holder_and_setting(cache_with_four, tmp_path) -> None:
    cache, _, manifest, src = cache_with_four
    impatient = NodeCache(cache.root, lock_timeout_s=0.1)
    key = f"e@1-{manifest.digest()[:12]}"
    with cache.locked(key), pytest.raises(LockTimeout) as err:
        stage(manifest, src, impatient, name="e", version=1)
    assert f"held by pid {os.getpid()}" in str(err.value)
    assert "raise NodeCache lock_timeout_s" in str(err.value)
