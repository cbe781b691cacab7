"""The import graph reads one way (docs/architecture.md, "Who imports what").

Every `import hpcserve.X` in the product packages, at module level or inside a function,
must follow an arrow of ALLOWED; an import outside them fails here with the file, the line
and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Folders that are packages of their own (pyproject's package-dir): folder -> package name.
FOLDERS = {
    "contracts": "contracts",
    "slurm": "slurm",
    "router": "router",
    "gateway": "gateway",
    "poolmgr": "poolmgr",
    "engine_launch": "engine_launch",
    "health": "health",
    "modelcache": "modelcache",
    "sim": "sim",
    "slurm_templates": "slurm_templates",
}

# What every component may use: the contracts, typed config and a few shared utilities.
FOUNDATION = (
    "contracts",
    "config",
    "ports",
    "port_reservations",
    "logs",
    "planner",
)

# source -> what it may import (a package, or one module of it: "modelcache.registry").
# Names are relative to `hpcserve.`; a source imports its own package freely.
ALLOWED: dict[str, tuple[str, ...]] = {
    # The contracts and the Slurm client stand on nothing of ours.
    "contracts": (),
    "slurm": (),
    # config checks the health tables and (pools[].tool_call_parser) vLLM's parser names.
    "config": ("contracts.health_policy", "contracts.engine_args"),
    "ports": ("port_reservations",),
    "port_reservations": (),
    "logs": (),
    "planner": ("config",),
    "tinymodels": (),
    # The components.
    "router": (*FOUNDATION, "modelcache.registry"),
    "gateway": (*FOUNDATION, "modelcache.registry"),
    "poolmgr": (*FOUNDATION, "slurm", "modelcache", "health.node_actions"),
    "engine_launch": (*FOUNDATION, "modelcache", "health"),
    "health": (*FOUNDATION, "slurm"),
    "modelcache": FOUNDATION,
    "sim": (*FOUNDATION, "engine_launch.agent"),
    "slurm_templates": (),
    # The commands on top: they wire components together; nothing imports them but these.
    "localslurm": ("slurm", "port_reservations", "ports", "local_accounting"),
    "local_accounting": (),
    # `hpcserve report`: Slurm's accounting and the usage records, priced.
    "report": (*FOUNDATION, "slurm"),
    "status": (*FOUNDATION, "poolmgr", "slurm"),
    # `hpcserve doctor`: gathers through the Slurm client, health's NVML and modelcache,
    # shapes its job like the pool manager's; the acceptance run drives the whole stack.
    "doctor": (*FOUNDATION, "slurm", "health", "modelcache", "poolmgr", "stack", "tinymodels"),
    "stack": (*FOUNDATION, "localslurm", "status", "tinymodels", "modelcache", "poolmgr", "slurm"),
    # Model onboarding (`models eval`): suites and the gate are pure; the eval run finds or
    # starts a replica with the pool manager's job code and records in the model registry.
    "onboarding": (*FOUNDATION, "modelcache", "poolmgr", "slurm"),
    "units": ("config",),
    "cli": ("*",),
}


def _source_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "hpcserve":
        return rel.parts[1].removesuffix(".py")
    return FOLDERS[rel.parts[0]]


def _product_files() -> list[Path]:
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    return sorted([*files, *(ROOT / "hpcserve").rglob("*.py")])


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "hpcserve" or node.module.count(".") == 1:
                # `from hpcserve.contracts import protocol`: the module is contracts.protocol
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [
        (line, name.removeprefix("hpcserve."))
        for line, name in found
        if name.startswith("hpcserve.")
    ]


def _allowed(source: str, target: str) -> bool:
    if target == source or target.startswith(source + "."):
        return True
    for arrow in ALLOWED[source]:
        if arrow == "*" or target == arrow or target.startswith(arrow + "."):
            return True
    return False


def test_every_import_follows_an_allowed_arrow():
    wrong = []
    for path in _product_files():
        source = _source_of(path)
        for line, target in _imports(path):
            if target.startswith("tests"):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the tests ({target})")
            elif not _allowed(source, target):
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line}: {source} -> {target} "
                    f"(allowed for {source}: {', '.join(ALLOWED[source]) or 'nothing of ours'})"
                )
    assert not wrong, "imports outside the allowed arrows:\n" + "\n".join(wrong)


def test_every_source_has_a_rule():
    sources = {_source_of(path) for path in _product_files()} - {"__init__"}
    assert sources <= set(ALLOWED), f"no import rule for {sorted(sources - set(ALLOWED))}"


@pytest.mark.parametrize(
    ("source", "target", "allowed"),
    [
        ("gateway", "contracts.protocol", True),
        ("gateway", "router.server", False),
        ("gateway", "cli", False),
        ("router", "health.monitor", False),
        ("router", "modelcache.registry", True),
        ("router", "modelcache.cache", False),
        ("health", "slurm.client", True),
        ("health", "poolmgr.manager", False),
        ("poolmgr", "gateway.batch.store", False),
        ("contracts", "config", False),
        ("cli", "gateway.server", True),
    ],
)
def test_the_rule_table_reads_as_documented(source, target, allowed):
    assert _allowed(source, target) is allowed
