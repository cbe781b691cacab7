"""The SQLite model registry (not the router's replica registry, see test_registry.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcserve.modelcache.manifest import FileEntry, Manifest
from hpcserve.modelcache.refs import RefError
from hpcserve.modelcache.registry import InUseError, NotFoundError, Registry, RegistryError


def manifest(tag: str = "0") -> Manifest:
    return Manifest("blake3", (FileEntry("model.safetensors", 1000, tag * 64),))


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(tmp_path / "state" / "registry.sqlite3", clock=lambda: 1700000000.0)
    r.add_version("llama-8b-docs", "/lustre/m/v1", manifest("1"))
    r.add_version(
        "llama-8b-docs", "/lustre/m/v2", manifest("2"), engine_args=["--max-model-len", "8192"]
    )
    r.add_version("llama-8b-docs", "/lustre/m/v3-awq", manifest("3"), quantization="awq")
    yield r
    r.close()


def test_versions_are_numbered_and_keep_their_manifest(reg: Registry) -> None:
    assert [v.ref for v in reg.versions()] == [
        "llama-8b-docs@1",
        "llama-8b-docs@2",
        "llama-8b-docs@3",
    ]
    v2 = reg.version("llama-8b-docs@2")
    assert v2.engine_args == ("--max-model-len", "8192") and v2.quantization == "bf16"
    assert v2.manifest_digest == manifest("2").digest() and v2.total_bytes == 1000
    assert reg.version("llama-8b-docs").version == 3  # a bare name is the latest
    assert reg.manifest("llama-8b-docs@1") == manifest("1")
    assert reg.add_version("llama-8b-docs", "/x", manifest("4"), version=10).version == 10
    assert reg.add_version("llama-8b-docs", "/x", manifest("5")).version == 11


def test_the_registry_survives_reopening(reg: Registry, tmp_path: Path) -> None:
    reg.set_alias("extraction", "llama-8b-docs@3")
    with Registry(tmp_path / "state" / "registry.sqlite3") as again:
        assert again.alias("extraction").target == "llama-8b-docs@3"
        assert len(again.versions()) == 3


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda r: r.add_version("llama", "/x", manifest(), quantization="int3"), RegistryError,
         "quantization 'int3' is not allowed; allowed: bf16, fp16, fp8, awq, gptq"),
        (lambda r: r.add_version("bad/name", "/x", manifest()), RefError, "'bad/name' is not allowed"),
        (lambda r: r.add_version("llama-8b-docs", "/x", manifest(), version=2), RegistryError,
         "version 2 of 'llama-8b-docs' exists"),
        (lambda r: r.add_version("llama", "/x", manifest(), engine_args="--x 1"), RegistryError,
         "engine args must be a list of strings"),
        (lambda r: r.version("llama-8b-docs@9"), NotFoundError,
         "llama-8b-docs@9 does not exist; versions of llama-8b-docs: 1, 2, 3"),
        (lambda r: r.version("qwen@1"), NotFoundError, "no model named 'qwen'"),
        (lambda r: r.version("llama@x"), RefError, "must be a positive integer, got 'x'"),
        (lambda r: r.alias("nope"), NotFoundError, "no alias named 'nope'"),
        (lambda r: r.set_alias("extraction", "qwen@1"), NotFoundError, "no model named 'qwen'"),
        (lambda r: r.set_alias("llama-8b-docs", "llama-8b-docs@1"), RegistryError,
         "'llama-8b-docs' is already the name of a model"),
        (lambda r: r.add_adapter("lora", "qwen", "/a", manifest(), rank=8), NotFoundError,
         "no model named 'qwen'"),
        (lambda r: r.add_adapter("lora", "llama-8b-docs", "/a", manifest(), rank=0), RegistryError,
         "LoRA rank must be a positive integer, got 0"),
        (lambda r: r.remove("qwen"), NotFoundError, "no model named 'qwen'"),
        (lambda r: r.mark_in_use("llama-8b-docs@1", ""), RegistryError, "replica id must not be empty"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_bad_value_and_change_nothing(reg, call, error, message) -> None:
    before = (reg.versions(), reg.aliases(), reg.adapters())
    with pytest.raises(error) as err:
        call(reg)
    assert message in str(err.value)
    assert (reg.versions(), reg.aliases(), reg.adapters()) == before


def test_alias_and_canary_promotion(reg: Registry) -> None:
    a = reg.set_alias("extraction", "llama-8b-docs@2")
    assert (a.target, a.canary, a.canary_percent) == ("llama-8b-docs@2", None, 0)
    a = reg.promote("extraction", "llama-8b-docs@3", share=10)
    assert (a.target, a.canary, a.canary_percent) == ("llama-8b-docs@2", "llama-8b-docs@3", 10)
    assert [a.pick(u) for u in (0.0, 0.0999, 0.1, 0.99)] == [
        "llama-8b-docs@3", "llama-8b-docs@3", "llama-8b-docs@2", "llama-8b-docs@2",
    ]  # fmt: skip
    assert reg.version("extraction").ref == "llama-8b-docs@2"  # an alias resolves to its target
    a = reg.promote("extraction", "llama-8b-docs@3", share=50)
    assert a.canary_percent == 50
    a = reg.promote("extraction", "llama-8b-docs@3")
    assert (a.target, a.canary, a.canary_percent) == ("llama-8b-docs@3", None, 0)
    reg.promote("extraction", "llama-8b-docs@1", share=5)
    a = reg.promote("extraction", "llama-8b-docs@1", share=0)
    assert (a.target, a.canary) == ("llama-8b-docs@3", None)
    a = reg.set_alias("extraction", "llama-8b-docs@1")  # re-pointing drops any canary
    assert a.target == "llama-8b-docs@1"


@pytest.mark.parametrize("share", [-1, 101, 2.5, True, "10"])
def test_canary_share_must_be_0_to_100(reg: Registry, share: object) -> None:
    reg.set_alias("extraction", "llama-8b-docs@2")
    with pytest.raises(RegistryError, match="canary share must be an integer from 0 to 100"):
        reg.promote("extraction", "llama-8b-docs@3", share)  # type: ignore[arg-type]
    assert reg.alias("extraction").canary is None


def test_promote_refusals(reg: Registry) -> None:
    reg.set_alias("extraction", "llama-8b-docs@2")
    with pytest.raises(RegistryError, match="llama-8b-docs@2 is already the target"):
        reg.promote("extraction", "llama-8b-docs@2", 20)
    with pytest.raises(RegistryError, match="llama-8b-docs@3 is not the canary"):
        reg.promote("extraction", "llama-8b-docs@3", 0)
    with pytest.raises(NotFoundError, match="no alias named 'other'"):
        reg.promote("other", "llama-8b-docs@3", 10)


def test_a_version_in_use_or_aliased_cannot_be_removed(reg: Registry) -> None:
    reg.mark_in_use("llama-8b-docs@1", "replica-a")
    reg.mark_in_use("llama-8b-docs@1", "replica-b")
    with pytest.raises(InUseError, match="in use by running replicas: replica-a, replica-b"):
        reg.remove("llama-8b-docs@1")
    with pytest.raises(InUseError, match="llama-8b-docs@1 is in use"):
        reg.remove("llama-8b-docs")  # the whole model: nothing removed
    assert len(reg.versions()) == 3
    assert reg.release("replica-a") == 1
    assert reg.release("replica-b", "llama-8b-docs@1") == 1
    reg.set_alias("extraction", "llama-8b-docs@2")
    reg.promote("extraction", "llama-8b-docs@3", 10)
    for ref in ("llama-8b-docs@2", "llama-8b-docs@3"):
        with pytest.raises(InUseError, match="target or canary of aliases: extraction"):
            reg.remove(ref)
    assert reg.remove("llama-8b-docs@1") == "llama-8b-docs@1"
    assert reg.remove("extraction") == "alias extraction"
    assert reg.remove("llama-8b-docs") == "llama-8b-docs@2, llama-8b-docs@3"
    assert reg.versions() == [] and reg.kind("llama-8b-docs") is None


def test_in_use_follows_an_alias_to_its_target(reg: Registry) -> None:
    reg.set_alias("extraction", "llama-8b-docs@2")
    reg.mark_in_use("extraction", "r1")
    assert reg.users("llama-8b-docs@2") == ["r1"]
    assert reg.model("llama-8b-docs").in_use == {"llama-8b-docs@2": ["r1"]}


def test_adapters_share_the_namespace_and_pin_their_base(reg: Registry) -> None:
    a = reg.add_adapter("docs-lora", "llama-8b-docs", "/lustre/lora/docs", manifest("a"), rank=16)
    assert (a.base_model, a.rank, a.manifest_digest) == (
        "llama-8b-docs",
        16,
        manifest("a").digest(),
    )
    assert reg.adapter_manifest("docs-lora") == manifest("a")
    assert reg.kind("docs-lora") == "adapter"
    with pytest.raises(RegistryError, match="'docs-lora' is already the name of an adapter"):
        reg.set_alias("docs-lora", "llama-8b-docs@1")
    with pytest.raises(RegistryError, match="adapter 'docs-lora' exists"):
        reg.add_adapter("docs-lora", "llama-8b-docs", "/x", manifest(), rank=8)
    with pytest.raises(InUseError, match="base model of adapters: docs-lora"):
        reg.remove("llama-8b-docs")
    assert [v.ref for v in reg.model("llama-8b-docs").versions][-1] == "llama-8b-docs@3"
    assert reg.model("llama-8b-docs").adapters == (reg.adapter("docs-lora"),)
    assert reg.remove("docs-lora") == "adapter docs-lora"


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    Registry(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(RegistryError, match="registry schema 99; this hpcserve knows 2"):
        Registry(path)


def test_an_adapter_is_bound_to_one_base_version(reg: Registry) -> None:
    assert reg.add_adapter("on-v2", "llama-8b-docs@2", "/l/a", manifest("a"), rank=8).base_ref == (
        "llama-8b-docs@2"
    )
    latest = reg.add_adapter("on-latest", "llama-8b-docs", "/l/b", manifest("b"), rank=8)
    assert latest.base_ref == "llama-8b-docs@3"
    reg.set_alias("docs", "llama-8b-docs@1")
    assert reg.add_adapter("on-alias", "docs", "/l/c", manifest("c"), rank=8).base_version == 1
    with pytest.raises(InUseError, match="llama-8b-docs@2 is the base model of adapters: on-v2"):
        reg.remove("llama-8b-docs@2")
    with pytest.raises(NotFoundError, match="llama-8b-docs@9 does not exist"):
        reg.add_adapter("on-v9", "llama-8b-docs@9", "/l/d", manifest("d"), rank=8)
    assert reg.kind("on-v9") is None
    reg.remove("on-v2")
    assert reg.remove("llama-8b-docs@2") == "llama-8b-docs@2"


SCHEMA_1_ADAPTERS = """CREATE TABLE adapters (
    name TEXT PRIMARY KEY, base_model TEXT NOT NULL REFERENCES models(name),
    rank INTEGER NOT NULL CHECK (rank >= 1), path TEXT NOT NULL, manifest TEXT NOT NULL,
    manifest_digest TEXT NOT NULL, total_bytes INTEGER NOT NULL, created REAL NOT NULL)"""


def test_a_schema_1_registry_binds_its_adapters_to_the_latest_base_version(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.sqlite3"
    with Registry(path) as r:
        r.add_version("m", "/l/m1", manifest("1"))
        r.add_version("m", "/l/m2", manifest("2"))
    db = sqlite3.connect(path)
    with db:  # what hpcserve with schema 1 wrote
        db.execute("DROP TABLE adapters")
        db.execute(SCHEMA_1_ADAPTERS)
        db.execute(
            "INSERT INTO adapters VALUES ('old', 'm', 8, '/l/a', ?, ?, 1000, 1.0)",
            (manifest("a").encode().decode(), manifest("a").digest()),
        )
        db.execute("PRAGMA user_version = 1")
    db.close()
    with Registry(path) as r:
        assert r.adapter("old").base_ref == "m@2"
        assert r.adapter_manifest("old") == manifest("a")
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (2,)
    db.close()
