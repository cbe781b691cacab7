"""Digest manifests: stable encoding, verification, and refusal of untrustworthy input."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import pytest

from hpcserve.modelcache.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    build_manifest,
    decode_manifest,
    hash_file,
    verify,
)
from tests.unit.modelcache_util import CHUNK, make_model


def test_manifest_is_deterministic_and_its_encoding_stable(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", seed=1)
    b = tmp_path / "b"
    b.mkdir()
    for name in reversed(sorted(os.listdir(a))):  # other creation order, same bytes
        src = a / name
        if src.is_dir():
            (b / name).mkdir()
            for f in src.iterdir():
                (b / name / f.name).write_bytes(f.read_bytes())
        else:
            (b / name).write_bytes(src.read_bytes())
    m1 = build_manifest(a, workers=1, chunk_bytes=CHUNK)
    m2 = build_manifest(b, workers=4, chunk_bytes=CHUNK * 3)
    assert m1 == m2 and m1.encode() == m2.encode() and m1.digest() == m2.digest()
    assert [f.path for f in m1.files] == sorted(f.path for f in m1.files)
    assert "tokenizer/tokenizer.json" in {f.path for f in m1.files}
    assert decode_manifest(m1.encode()) == m1
    assert m1.encode().startswith(b'{"algorithm":"blake3","files":[["config.json",')


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_digests_are_the_plain_file_digests(tmp_path: Path, algorithm: str) -> None:
    d = make_model(tmp_path)
    m = build_manifest(d, algorithm=algorithm, chunk_bytes=CHUNK)
    hasher = {"blake3": blake3.blake3, "sha256": hashlib.sha256}[algorithm]
    for f in m.files:
        data = (d / f.path).read_bytes()
        assert (f.size, f.digest) == (len(data), hasher(data).hexdigest())
    assert m.total_bytes == sum(f.size for f in m.files)


def test_verify_names_missing_resized_and_altered_files(tmp_path: Path) -> None:
    d = make_model(tmp_path)
    m = build_manifest(d, chunk_bytes=CHUNK)
    assert verify(m, d) == []
    (d / "empty.txt").unlink()
    with open(d / "config.json", "ab") as f:
        f.write(b" ")
    shard = d / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[1_234_567] ^= 0xFF
    shard.write_bytes(bytes(data))
    (d / "extra.bin").write_bytes(b"not in the manifest: ignored")
    problems = verify(m, d, chunk_bytes=CHUNK)
    assert [(p.path, p.problem) for p in problems] == [
        ("config.json", "size"),
        ("empty.txt", "missing"),
        ("model-00001-of-00002.safetensors", "digest"),
    ]
    expected = next(f.digest for f in m.files if f.path == shard.name)
    assert expected in str(problems[2])
    assert [p.problem for p in verify(m, d, sizes_only=True)] == ["size", "missing"]


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (Manifest("md5", ()), "algorithm 'md5' is not supported; allowed: blake3, sha256"),
        (Manifest("blake3", (FileEntry("../etc/passwd", 1, "0" * 64),)), "'../etc/passwd'"),
        (Manifest("blake3", (FileEntry("/abs", 1, "0" * 64),)), "'/abs' must be relative"),
        (Manifest("blake3", (FileEntry("b", 1, "0" * 64), FileEntry("a", 1, "0" * 64))), "sorted"),
        (Manifest("blake3", (FileEntry("a", 1, "xyz"),)), "'a': bad size 1 or digest"),
        (Manifest("blake3", (FileEntry(".hpcserve-entry.json", 1, "0" * 64),)), "reserved"),
    ],
)
def test_decode_refuses_bad_manifests(manifest: Manifest, message: str) -> None:
    with pytest.raises(ManifestError) as err:
        decode_manifest(manifest.encode())
    assert message in str(err.value)


def test_decode_refuses_malformed_json() -> None:
    with pytest.raises(ManifestError, match="manifest is not valid"):
        decode_manifest(b'{"algorithm": "blake3", "files": [["a", "big", "00"]]}')


def test_build_refuses_missing_dir_unknown_algorithm_and_symlinked_dirs(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="does not exist"):
        build_manifest(tmp_path / "nope")
    d = make_model(tmp_path / "m")
    with pytest.raises(ManifestError, match="'crc32' is not supported"):
        build_manifest(d, algorithm="crc32")
    (d / "linked").symlink_to(d / "tokenizer")
    with pytest.raises(ManifestError, match="symlinked directories are not followed"):
        build_manifest(d)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 4096 + 5])
@pytest.mark.parametrize("chunk", [4096, 5000, 1 << 20])
def test_hashing_mapped_gives_the_same_digest(tmp_path: Path, size: int, chunk: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(size))
    for algorithm in ("blake3", "sha256"):
        plain = hash_file(path, algorithm, chunk, None)
        assert hash_file(path, algorithm, chunk, None, mapped=True) == plain
