"""Staging into the node cache: verified copies, atomic publication, one copy per node."""

from __future__ import annotations

import errno
import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from hpcserve.modelcache.cache import NodeCache
from hpcserve.modelcache.copier import ChunkCopier, _FileCopy, _interleave
from hpcserve.modelcache.errors import DigestMismatchError, SourceChangedError
from hpcserve.modelcache.manifest import FileEntry, Manifest, build_manifest, new_hasher
from hpcserve.modelcache.stage import stage
from tests.unit.modelcache_util import CHUNK, Child, make_model, tree_bytes

CHILD = """
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from hpcserve.modelcache.cache import NodeCache
from hpcserve.modelcache.manifest import decode_manifest
from hpcserve.modelcache.stage import stage

class Hang:
    def advance(self, n):
        print("copying", flush=True)
        time.sleep(3600)

manifest = decode_manifest(Path({manifest!r}).read_bytes())
print("started", flush=True)
r = stage(manifest, Path({source!r}), NodeCache(Path({cache!r})), name="m", version=1,
          chunk_bytes={chunk}, progress=Hang() if {hang} else None)
print("copied" if r.copied else "hit", flush=True)
"""


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Manifest]:
    src = make_model(tmp_path / "src")
    return src, build_manifest(src, chunk_bytes=CHUNK)


def _stage(src: Path, manifest: Manifest, cache: NodeCache, **kw: object):  # type: ignore[no-untyped-def]
    return stage(manifest, src, cache, name="m", version=1, chunk_bytes=CHUNK, workers=4, **kw)  # type: ignore[arg-type]


def _leftovers(cache: NodeCache) -> list[str]:
    return sorted(p.name for p in cache.root.iterdir() if p.name.startswith((".staging", ".trash")))


def test_stage_copies_verifies_and_publishes_under_the_model_key(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    staged = _stage(src, manifest, cache)
    assert staged.copied and staged.key == f"m@1-{manifest.digest()[:12]}"
    assert staged.path == cache.root / staged.key
    assert tree_bytes(staged.path) == tree_bytes(src)
    assert {stat.S_IMODE(p.stat().st_mode) for p in staged.path.rglob("*") if p.is_file()} == {
        0o444
    }  # an engine cannot scribble on the cache by accident
    record = cache.read_record(staged.key)
    assert record is not None and record.manifest == manifest and record.source == str(src)
    assert _leftovers(cache) == []
    again = _stage(src, manifest, cache)
    assert not again.copied and again.path == staged.path


def test_durable_stage_and_the_pread_fallback_copy_the_same_bytes(tmp_path, model, monkeypatch):
    src, manifest = model

    def no_sendfile(*args: object) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    durable = _stage(src, manifest, NodeCache(tmp_path / "c1"), durable=True)
    monkeypatch.setattr(os, "sendfile", no_sendfile)
    fallback = _stage(src, manifest, NodeCache(tmp_path / "c2"))
    assert tree_bytes(durable.path) == tree_bytes(fallback.path) == tree_bytes(src)


def test_an_exception_mid_copy_leaves_nothing_that_looks_complete(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")

    class Boom:
        def advance(self, n: int) -> None:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        _stage(src, manifest, cache, progress=Boom())
    assert cache.entry_keys() == [] and _leftovers(cache) == []
    assert _stage(src, manifest, cache).copied


def test_a_stager_killed_mid_copy_leaves_no_entry_and_the_next_one_cleans_up(tmp_path, model):
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    (tmp_path / "manifest.json").write_bytes(manifest.encode())
    child = Child(
        CHILD.format(
            manifest=str(tmp_path / "manifest.json"),
            source=str(src),
            cache=str(cache.root),
            chunk=CHUNK,
            hang=True,
        )
    )
    child.wait_for("copying")
    os.kill(child.proc.pid, signal.SIGKILL)
    child.finish()
    assert cache.entry_keys() == [] and len(_leftovers(cache)) == 1
    staged = _stage(src, manifest, cache)  # the dead child's flock is gone with it
    assert staged.copied and _leftovers(cache) == []
    assert tree_bytes(staged.path) == tree_bytes(src)


def test_concurrent_threads_copy_once(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    barrier = threading.Barrier(4)
    results = []

    class Slow:
        def advance(self, n: int) -> None:
            time.sleep(0.002)

    def run() -> None:
        barrier.wait()
        results.append(_stage(src, manifest, cache, progress=Slow()))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r.copied for r in results) == [False, False, False, True]
    assert len({r.path for r in results}) == 1


def test_a_second_process_waits_for_the_first_stager(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    (tmp_path / "manifest.json").write_bytes(manifest.encode())
    copying, release = threading.Event(), threading.Event()

    class Held:
        def advance(self, n: int) -> None:
            copying.set()
            assert release.wait(30)

    results = []
    first = threading.Thread(
        target=lambda: results.append(_stage(src, manifest, cache, progress=Held()))
    )
    first.start()
    assert copying.wait(10)
    child = Child(
        CHILD.format(
            manifest=str(tmp_path / "manifest.json"),
            source=str(src),
            cache=str(cache.root),
            chunk=CHUNK,
            hang=False,
        )
    )
    line = child.wait_for("waiting for")
    assert f"pid {os.getpid()}" in line  # it names whom it waits for
    release.set()
    first.join(30)
    child.wait_for("hit")
    assert child.finish() == 0
    assert [r.copied for r in results] == [True]


def flip_bit(shard: Path, offset: int) -> bytes:
    """Corrupt one bit of a staged (read-only) file in place; the new content."""
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01
    shard.write_bytes(data)
    return bytes(data)


def test_a_corrupt_cached_file_is_detected_and_restaged(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    staged = _stage(src, manifest, cache)
    flip_bit(staged.path / "model-00002-of-00002.safetensors", 777)
    again = _stage(src, manifest, cache)
    assert again.copied and tree_bytes(again.path) == tree_bytes(src)


def test_size_only_hits_catch_truncation_but_not_flipped_bits(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    staged = _stage(src, manifest, cache)
    shard = staged.path / "model-00001-of-00002.safetensors"
    data = flip_bit(shard, 5)
    assert not _stage(src, manifest, cache, verify_hit=False).copied  # the documented trade
    shard.write_bytes(bytes(data[:-1]))
    assert _stage(src, manifest, cache, verify_hit=False).copied


def test_a_source_that_changed_since_the_manifest_is_refused(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    shard = src / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[2_000_000] ^= 0x80
    shard.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError) as err:
        _stage(src, manifest, cache)
    expected = next(f.digest for f in manifest.files if f.path == shard.name)
    assert shard.name in str(err.value) and expected in str(err.value)
    assert err.value.actual in str(err.value) and err.value.actual != expected
    assert cache.entry_keys() == [] and _leftovers(cache) == []
    with open(shard, "ab") as f:
        f.write(b"more")
    with pytest.raises(SourceChangedError, match="3000004 bytes, but the manifest says 3000000"):
        _stage(src, manifest, cache)


def test_stage_can_lease_the_entry_for_the_engine(tmp_path, model) -> None:
    src, manifest = model
    cache = NodeCache(tmp_path / "cache")
    staged = _stage(src, manifest, cache, lease_pid=os.getpid())
    assert cache.entry(staged.key).leases == 1


def test_copier_interleaves_files_and_keeps_each_files_chunks_in_order() -> None:
    files = [
        _FileCopy(FileEntry(name, 0, ""), chunks, new_hasher("sha256"))
        for name, chunks in (("a", 3), ("b", 1), ("c", 2))
    ]
    order = [(fc.entry.path, i) for fc, i in _interleave(files, window=2)]
    assert order == [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("a", 2), ("c", 1)]


def test_copier_refuses_chunks_that_cannot_be_mapped(tmp_path) -> None:
    with pytest.raises(ValueError, match="multiple of"):
        ChunkCopier(Manifest("blake3", ()), tmp_path, chunk_bytes=1000)
