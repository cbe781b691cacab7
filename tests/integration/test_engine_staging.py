"""A registry model staged into the node cache by the engine job before its engine starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hpcserve.config import parse_config
from hpcserve.contracts.router_client import list_replicas
from hpcserve.modelcache.cache import NodeCache
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr.render import render
from hpcserve.poolmgr.spec import build_job_spec, resolve_model
from hpcserve.router.server import RouterServer
from hpcserve.tinymodels import make_tiny_model


def test_pool_model_ref_resolves_and_the_engine_stages_before_serving(
    router: RouterServer, tmp_path: Path
) -> None:
    source = make_tiny_model("embed", tmp_path / "shared" / "tiny-embed")
    registry = Registry(tmp_path / "registry.sqlite3")
    registry.add_version("tiny", str(source), build_manifest(source))
    registry.set_alias("embedder", "tiny@1")
    registry.close()
    config = parse_config(
        {
            "state_dir": str(tmp_path / "state"),
            "registry": str(tmp_path / "registry.sqlite3"),
            "engine": {
                "cache_dir": str(tmp_path / "nvme"),
                "bind_host": "127.0.0.1",
                "advertise_host": "127.0.0.1",
            },
            "pools": [{"name": "emb", "model_ref": "embedder", "engine": "sim"}],
        }
    )
    resolved = resolve_model(config, config.pools[0])
    assert (resolved.model_ref, resolved.model_path) == ("tiny@1", str(source))
    assert Path(resolved.manifest).parent == tmp_path / "state" / "manifests"
    script = render(build_job_spec(config, config.pools[0], resolved))
    assert f"HPCSERVE_MANIFEST={resolved.manifest}" in script
    assert f"HPCSERVE_CACHE_DIR={tmp_path / 'nvme'}" in script

    (tmp_path / "nvme").mkdir()
    engine = subprocess.Popen(
        [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "sim",
         "--model-path", resolved.model_path, "--served-model-name", "emb",
         "--router", router.config.registry_bind, "--bind-host", "127.0.0.1",
         "--advertise-host", "127.0.0.1", "--heartbeat-s", "0.25",
         "--cache-dir", str(tmp_path / "nvme"), "--manifest", resolved.manifest,
         "--model-ref", resolved.model_ref],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not list_replicas(router.config.routing_bind):
            assert engine.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        (entry,) = NodeCache(tmp_path / "nvme").entries()
        assert entry.key.startswith("tiny@1-")
        assert entry.leases == 1, "leased by the running engine, so never evicted under it"
        staged = tmp_path / "nvme" / entry.key
        files = sorted(p.name for p in staged.iterdir() if p.name != ".hpcserve-entry.json")
        assert files == sorted(p.name for p in source.iterdir())
    finally:
        engine.terminate()
        out, _ = engine.communicate(timeout=30)
    assert "model tiny@1 staged at" in out, out
    assert engine.returncode == 0
