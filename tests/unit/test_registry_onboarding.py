"""The registry's part of onboarding: evaluations per version, the gate rule per model, and
traffic moves (alias, promote) only to a version that passed its gate, or forced with a
reason and an audit line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcserve.modelcache.evaluations import Evaluation, MetricResult
from hpcserve.modelcache.manifest import FileEntry, Manifest
from hpcserve.modelcache.registry import GateRefused, Registry, RegistryError


def manifest(tag: str) -> Manifest:
    return Manifest("blake3", (FileEntry("model.safetensors", 1000, tag * 64),))


def evaluation(ref: str, passed: bool, baseline: str = "") -> Evaluation:
    return Evaluation(
        ref=ref,
        suite="bol",
        suite_digest="0" * 64,
        suite_path="bol.jsonl",
        cases=6,
        scores={"fields": 90.0 if passed else 10.0},
        key_metrics=["fields"],
        passed=passed,
        results=[MetricResult("fields", 90.0 if passed else 10.0, passed=passed)],
        reasons=[] if passed else ["fields 10 is 80.00 points below the baseline's 90"],
        baseline=baseline,
        engine_version="0.32.0",
        engine_args=["--dtype", "float32"],
    )


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Registry]:
    r = Registry(tmp_path / "registry.sqlite3", clock=lambda: 1700000000.0)
    for tag in "123":
        r.add_version("docs", f"/models/v{tag}", manifest(tag))
    yield r
    r.close()


def test_evaluations_are_kept_per_version_and_the_newest_decides(reg: Registry) -> None:
    assert reg.gate_status("docs@2") == (
        False,
        "docs@2 has no evaluation (`hpcserve models eval docs@2 --suite FILE`)",
    )
    first = reg.record_evaluation(evaluation("docs@2", passed=True, baseline="docs@1"))
    assert first.id > 0 and first.at == 1700000000.0
    assert reg.gate_status("docs@2") == (
        True,
        f"gate passed: evaluation {first.id} (bol vs docs@1)",
    )
    reg.record_evaluation(evaluation("docs@2", passed=False, baseline="docs@1"))
    passed, why = reg.gate_status("docs@2")
    assert not passed and "failed its gate" in why and "80.00 points below" in why
    assert [e.passed for e in reg.evaluations("docs@2")] == [True, False]
    assert reg.latest_evaluation("docs@2") == reg.evaluations("docs@2")[-1]
    assert reg.evaluations("docs@1") == []


def test_an_evaluation_names_one_existing_version(reg: Registry) -> None:
    with pytest.raises(RegistryError, match="docs@9 does not exist"):
        reg.record_evaluation(evaluation("docs@9", passed=True))
    with pytest.raises(RegistryError, match="names one version"):
        reg.record_evaluation(evaluation("docs", passed=True))


def test_removing_a_version_removes_its_evaluations(reg: Registry) -> None:
    reg.record_evaluation(evaluation("docs@3", passed=True))
    reg.remove("docs@3")
    reg.add_version("docs", "/models/v3b", manifest("4"), version=3)
    assert reg.evaluations("docs@3") == []


def test_the_gate_rule_is_per_model_with_a_default(reg: Registry) -> None:
    assert reg.gate_rule("docs").max_drop == 1.0
    assert reg.set_gate_rule("docs", 2.5, actor="admin").max_drop == 2.5
    assert reg.gate_rule("docs").max_drop == 2.5
    assert reg.audit_log("docs")[-1].line() == "gate docs -> : max drop 2.5 points by admin"
    with pytest.raises(RegistryError, match="max drop must be a number of points >= 0"):
        reg.set_gate_rule("docs", -1)
    with pytest.raises(RegistryError, match="no model named 'nope'"):
        reg.set_gate_rule("nope", 1)


def test_alias_and_promote_move_traffic_only_to_a_version_that_passed(reg: Registry) -> None:
    with pytest.raises(GateRefused, match=r"docs@1 has no evaluation.*--force --reason"):
        reg.set_alias_gated("extraction", "docs@1")
    assert reg.kind("extraction") is None  # refused: nothing changed
    reg.record_evaluation(evaluation("docs@1", passed=True))
    reg.set_alias_gated("extraction", "docs@1", actor="admin")
    reg.record_evaluation(evaluation("docs@2", passed=False, baseline="docs@1"))
    for share in (10, 100):
        with pytest.raises(GateRefused, match="docs@2 failed its gate"):
            reg.promote_gated("extraction", "docs@2", share)
    assert reg.alias("extraction").target == "docs@1"
    assert reg.alias("extraction").canary is None
    reg.record_evaluation(evaluation("docs@3", passed=True, baseline="docs@1"))
    a = reg.promote_gated("extraction", "docs@3", 10, actor="admin")
    assert (a.canary, a.canary_percent) == ("docs@3", 10)
    # taking traffic away needs no gate; neither does re-pointing at the target it has
    reg.promote_gated("extraction", "docs@3", 0, actor="admin")
    reg.set_alias_gated("extraction", "docs@1", actor="admin")
    lines = [e.line() for e in reg.audit_log("extraction")]
    assert lines == [
        "alias extraction -> docs@1: gate passed: evaluation 1 (bol (no baseline)) by admin",
        "promote extraction -> docs@3: share 10%; gate passed: evaluation 3 (bol vs docs@1) "
        "by admin",
        "promote extraction -> docs@3: share 0%; no gate needed (no traffic moves to it) by admin",
        "alias extraction -> docs@1: no gate needed (no traffic moves to it) by admin",
    ]


def test_a_forced_move_needs_a_reason_and_leaves_an_audit_line(reg: Registry) -> None:
    reg.record_evaluation(evaluation("docs@1", passed=True))
    reg.set_alias_gated("extraction", "docs@1")
    reg.record_evaluation(evaluation("docs@2", passed=False, baseline="docs@1"))
    with pytest.raises(GateRefused):
        reg.promote_gated("extraction", "docs@2", force_reason="   ")
    a = reg.promote_gated(
        "extraction", "docs@2", force_reason="hotfix for INC-42, eval suite outdated", actor="bob"
    )
    assert a.target == "docs@2"
    last = reg.audit_log("extraction")[-1]
    assert last.forced and last.reason == "hotfix for INC-42, eval suite outdated"
    assert last.line().startswith("promote extraction -> docs@2: share 100%; gate overridden: ")
    assert last.line().endswith(" FORCED (hotfix for INC-42, eval suite outdated) by bob")


def test_an_old_registry_file_gains_the_tables(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite3"
    Registry(path).close()
    import sqlite3

    db = sqlite3.connect(path)
    db.execute("DROP TABLE evaluations")
    db.execute("DROP TABLE audit")
    db.commit()
    db.close()
    with Registry(path) as reg:
        reg.add_version("docs", "/m", manifest("1"))
        reg.record_evaluation(evaluation("docs@1", passed=True))
        assert reg.gate_status("docs@1")[0]
