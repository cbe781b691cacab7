"""The copier on its own: the same bytes whatever the number of threads, and the first
error stopping every thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.modelcache.copier import ChunkCopier
from hpcserve.modelcache.errors import DigestMismatchError
from hpcserve.modelcache.manifest import Manifest, build_manifest
from tests.unit.modelcache_util import CHUNK, make_model, tree_bytes


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Manifest]:
    src = make_model(tmp_path / "src")
    return src, build_manifest(src, chunk_bytes=CHUNK)


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_every_thread_count_copies_the_same_bytes(tmp_path, model, workers) -> None:
    src, manifest = model
    dst = tmp_path / "dst"
    dst.mkdir()
    ChunkCopier(manifest, src, workers, chunk_bytes=CHUNK).run(dst)
    assert tree_bytes(dst) == tree_bytes(src)


def test_an_empty_manifest_copies_nothing(tmp_path) -> None:
    ChunkCopier(Manifest("blake3", ()), tmp_path).run(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("workers", [1, 8])
def test_a_mismatch_in_the_last_chunk_stops_the_copy_and_names_the_file(
    tmp_path, model, workers
) -> None:
    src, manifest = model
    shard = src / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # every other chunk of the file is copied and hashed first
    shard.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    dst.mkdir()
    with pytest.raises(DigestMismatchError, match=shard.name):
        ChunkCopier(manifest, src, workers, chunk_bytes=CHUNK).run(dst)
