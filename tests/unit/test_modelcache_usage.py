"""poolmgr/registry_usage.py: the registry records which replica serves which version, from
the router's replica list, so a served version cannot be removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import InUseError, Registry
from hpcserve.poolmgr.registry_usage import RegistryUsage


def replica(rid: str, ref: str) -> ReplicaInfo:
    return ReplicaInfo(rid, "m", "http://x", "p", 1, "n1", 0, 0, 0, ReplicaLoad(), model_ref=ref)


@pytest.fixture
def registry_path(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"weights")
    path = tmp_path / "registry.sqlite3"
    with Registry(path) as reg:
        reg.add_version("m", str(src), build_manifest(src))
        reg.add_version("m", str(src), build_manifest(src))
    return path


def test_served_versions_are_recorded_and_released(registry_path: Path) -> None:
    usage = RegistryUsage(str(registry_path))
    usage.sync([replica("r1", "m@1"), replica("r2", "m@2"), replica("admin", "")])
    with Registry(registry_path) as reg:
        assert reg.usage() == [("r1", "m@1"), ("r2", "m@2")]
        with pytest.raises(InUseError, match="r1"):
            reg.remove("m@1")
    usage.sync([replica("r2", "m@2")])
    with Registry(registry_path) as reg:
        assert reg.usage() == [("r2", "m@2")]
        assert reg.remove("m@1") == "m@1"


def test_a_restarted_pool_manager_drops_rows_of_replicas_gone_meanwhile(
    registry_path: Path,
) -> None:
    with Registry(registry_path) as reg:
        reg.mark_in_use("m@1", "died-while-down")
    RegistryUsage(str(registry_path)).sync([replica("r2", "m@2")])
    with Registry(registry_path) as reg:
        assert reg.usage() == [("r2", "m@2")]


def test_a_removed_version_or_a_missing_registry_is_not_an_error(
    registry_path: Path, tmp_path: Path
) -> None:
    usage = RegistryUsage(str(registry_path))
    usage.sync([replica("r1", "m@9")])  # not in the registry: logged, nothing recorded
    with Registry(registry_path) as reg:
        assert reg.usage() == []
    missing = tmp_path / "none.sqlite3"
    RegistryUsage(str(missing)).sync([])
    assert not missing.exists()
