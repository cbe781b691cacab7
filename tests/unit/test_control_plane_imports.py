"""The control plane (gateway, router, pool manager, CLI) must import without torch or vLLM."""

import subprocess
import sys

BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "vllm", "transformers"}:
            raise ImportError(f"{name} must not be imported by the control plane")
sys.meta_path.insert(0, Block())
"""

MODULES = [
    "hpcserve.cli",
    "hpcserve.config",
    "hpcserve.stack",
    "hpcserve.status",
    "hpcserve.localslurm",
    "hpcserve.tinymodels",
    "hpcserve.gateway.app",
    "hpcserve.gateway.server",
    "hpcserve.gateway.batch.process",
    "hpcserve.router.server",
    "hpcserve.contracts.router_client",
    "hpcserve.poolmgr.manager",
    "hpcserve.poolmgr.launchers",
    "hpcserve.poolmgr.shutdown",
    "hpcserve.engine_launch.engine",
]


def test_control_plane_imports_without_torch_or_vllm():
    code = (
        BLOCK_HEAVY
        + "".join(f"import {m}\n" for m in MODULES)
        + (
            "from hpcserve.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert not {'torch', 'vllm', 'transformers'} & set(sys.modules)\n"
        )
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "hpcserve" in out.stdout and "router" in out.stdout
