"""Golden records in the registry, `hpcserve models canary show|clear|prompts`, the
record files the pool manager keeps for the jobs, and the health monitor's periodic canary
(health/canary.py) driven with a fake clock and checker."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import HealthConfig
from hpcserve.contracts import protocol as p
from hpcserve.contracts.canary import (
    DEFAULT_PROMPTS,
    CanaryAnswer,
    CanarySettings,
    CanaryToken,
    GoldenRecord,
    Mismatch,
    encode_record,
)
from hpcserve.contracts.canary_client import CanaryRunError
from hpcserve.contracts.router_client import list_health_events, list_replicas
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.health.canary import CanaryWatch
from hpcserve.health.policy import Policy
from hpcserve.modelcache.canary import canary_settings
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry, RegistryError
from hpcserve.poolmgr.canary_records import CanaryRecords, record_path, write_record_file
from tests.integration.slurm_helpers import wait_for
from tests.routers import loopback_router_config, running_router
from tests.unit.modelcache_util import make_model


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """`hpcserve models ...` through the real argparse tree, on a registry in tmp_path."""
    from hpcserve.cli import build_parser

    def run(*argv: str) -> tuple[int, str, str]:
        ns = build_parser().parse_args([*argv, "--registry", str(tmp_path / "registry.sqlite3")])
        code = ns.func(ns)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def golden(ref: str = "m@1", *, tol: float = 0.1, first: int = 7) -> GoldenRecord:
    settings = CanarySettings(prompts=("a", "b"), max_tokens=2, logprob_tol=tol)
    tokens = [CanaryToken(first, -0.5, {first: -0.5}), CanaryToken(8, -0.25, {8: -0.25})]
    return GoldenRecord(
        ref, settings, [CanaryAnswer("a", tokens), CanaryAnswer("b", tokens)], 1.0, "http://x"
    )


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    src = make_model(tmp_path / "src")
    reg = Registry(tmp_path / "registry.sqlite3")
    reg.add_version("m", str(src), build_manifest(src))
    reg.add_version("m", str(src), build_manifest(src))
    return reg


def test_a_version_keeps_its_golden_record(registry: Registry) -> None:
    assert registry.canary_record("m@1") is None
    registry.set_canary_record("m@1", golden())
    assert registry.canary_record("m@1") == golden()
    registry.set_alias("prod", "m@1")
    assert registry.canary_record("prod") == golden(), "an alias reads its target's"
    assert registry.canary_record("m@2") is None
    with pytest.raises(RegistryError, match="made for m@1, not m@2"):
        registry.set_canary_record("m@2", golden())
    bad = GoldenRecord("m@2", CanarySettings(max_tokens=0), [])
    with pytest.raises(RegistryError, match="max_tokens: 0"):
        registry.set_canary_record("m@2", bad)
    assert registry.clear_canary_record("m@1") and not registry.clear_canary_record("m@1")


def test_removing_a_version_or_model_removes_its_canaries(registry: Registry) -> None:
    registry.set_canary_record("m@2", golden("m@2"))
    registry.set_canary_prompts("m", ["hello"])
    registry.remove("m@2")
    registry.add_version(
        "m", "/src", build_manifest(Path(registry.version("m@1").source)), version=2
    )
    assert registry.canary_record("m@2") is None, "a new m@2 starts without the old record"
    registry.remove("m")
    rows = registry._db.execute("SELECT COUNT(*) FROM canary_prompts").fetchone()
    assert rows == (0,)


def test_a_model_may_have_its_own_prompts(registry: Registry) -> None:
    assert registry.canary_prompts("m") is None
    assert canary_settings(registry, "m@1").prompts == DEFAULT_PROMPTS
    registry.set_canary_prompts("m", ["Invoice total:", "Port of loading:"])
    assert canary_settings(registry, "m@1", max_tokens=4).prompts == (
        "Invoice total:",
        "Port of loading:",
    )
    assert canary_settings(registry, "m@1", prompts=("x",)).prompts == ("x",)
    with pytest.raises(RegistryError, match="canary prompts: a list of non-empty strings"):
        registry.set_canary_prompts("m", [""])
    with pytest.raises(RegistryError, match="canary positions: 9"):
        canary_settings(registry, "m@1", max_tokens=4, positions=9)
    registry.set_canary_prompts("m", None)
    assert registry.canary_prompts("m") is None


def test_a_registry_made_before_the_canaries_gains_their_tables(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    Registry(path).close()
    db = sqlite3.connect(path)
    db.executescript(
        "DROP TABLE canary_records; DROP TABLE canary_prompts; PRAGMA user_version = 2;"
    )
    db.close()
    src = make_model(tmp_path / "src")
    with Registry(path) as reg:
        reg.add_version("m", str(src), build_manifest(src))
        reg.set_canary_record("m@1", golden())
        assert reg.canary_record("m") == golden()
        assert reg._db.execute("PRAGMA user_version").fetchone() == (2,), "no new schema number"


def test_canary_show_clear_and_prompts_commands(cli, tmp_path: Path) -> None:
    src = str(make_model(tmp_path / "src"))
    assert cli("models", "add", "m", src)[0] == 0
    code, _, err = cli("models", "canary", "show", "m@1")
    assert code == 2 and err == "hpcserve models canary show: m@1 has no golden record\n"
    with Registry(tmp_path / "registry.sqlite3") as reg:
        reg.set_canary_record("m@1", golden())
    code, out, _ = cli("models", "canary", "show", "m")
    assert code == 0 and "golden record of m@1" in out and "prompt 1: 'b' -> 7 8" in out
    assert "logprob tolerance 0.1" in out
    assert '"model_ref": "m@1"' in cli("models", "canary", "show", "m@1", "--json")[1]
    code, _, err = cli("models", "canary", "check", "m@9", "--url", "http://127.0.0.1:1")
    assert code == 2 and "m@9 does not exist" in err
    assert cli("models", "canary", "clear", "m@1")[1] == "cleared the golden record of m@1\n"
    assert cli("models", "canary", "clear", "m@1")[1] == "m@1 had no golden record\n"
    code, _, err = cli("models", "canary", "check", "m@1", "--url", "http://127.0.0.1:1")
    assert code == 2 and "m@1 has no golden record" in err

    prompts = tmp_path / "prompts.json"
    prompts.write_text('["Consignee:", "Gross weight (kg):"]')
    code, out, _ = cli("models", "canary", "prompts", "m", str(prompts))
    assert out == "m: its own canary prompts\n  'Consignee:'\n  'Gross weight (kg):'\n"
    prompts.write_text('{"not": "a list"}')
    code, _, err = cli("models", "canary", "prompts", "m", str(prompts))
    assert code == 2 and "expected a JSON list of non-empty strings" in err
    code, out, _ = cli("models", "canary", "prompts", "m", "--default")
    assert out.startswith("m: the shipped canary prompts\n")


def test_record_files_follow_the_registry(registry: Registry, tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = write_record_file(registry, state, "m@1")
    assert path == record_path(state, "m@1") == state / "canaries" / "m@1.json"
    assert not path.exists(), "no record: no file (the job still gets the path)"
    registry.set_canary_record("m@1", golden())
    write_record_file(registry, state, "m@1")
    assert path.read_bytes() == encode_record(golden())
    registry.clear_canary_record("m@1")
    write_record_file(registry, state, "m@1")
    assert not path.exists(), "a cleared record's file goes"


def test_the_pool_manager_syncs_the_files_of_served_versions(
    registry: Registry, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    records = CanaryRecords(state, str(registry.path), every_s=30.0)
    records.sync(["m@1"], now=100.0)
    registry.set_canary_record("m@1", golden())
    records.sync(["m@1"], now=110.0)
    assert not record_path(state, "m@1").exists(), "not before every_s"
    records.sync(["m@1", "m@1"], now=130.0)
    assert record_path(state, "m@1").exists()
    records.sync(["gone@3"], now=200.0)  # a version removed meanwhile: logged, not raised


class FakeChecker:
    """Stands in for contracts.canary_client.check_replica: answers as told, counts calls."""

    def __init__(self) -> None:
        self.answer: Mismatch | Exception | None = None
        self.calls = 0

    def __call__(self, url, model, record, *, engine_token, deadline_s):  # type: ignore[no-untyped-def]
        self.calls += 1
        assert (url, model, engine_token) == ("http://e", "tiny", "tok")
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_the_periodic_canary(tmp_path: Path) -> None:
    now = [0.0]
    checker = FakeChecker()
    path = tmp_path / "m@1.json"
    watch = CanaryWatch(
        str(path),
        engine_url="http://e",
        model="tiny",
        model_ref="m@1",
        policy=Policy(HealthConfig()),
        interval_s=60.0,
        deadline_s=5.0,
        engine_token="tok",
        clock=lambda: now[0],
        checker=checker,
    )
    assert watch.round() == ([], None) and checker.calls == 0, "no record yet"

    path.write_bytes(encode_record(golden()))
    findings, outcome = watch.round()
    assert findings == [] and outcome is not None and outcome.result == "pass"
    assert checker.calls == 1, "a record that appears is checked at once"
    now[0] = 30.0
    assert watch.round() == ([], None), "then every interval_s"

    checker.answer = Mismatch(1, 4, "token 9, golden 7")
    now[0] = 61.0
    findings, outcome = watch.round()
    assert outcome is not None and outcome.result == "mismatch"
    assert [(f.check, f.action, f.detail) for f in findings] == [
        (
            "numerical_canary",
            "stop_routing",
            "numerical canary mismatch at position 4 (prompt 1): token 9, golden 7",
        )
    ]
    now[0] = 70.0
    assert watch.round() == (findings, None), "the finding stays in rounds without a canary"

    checker.answer = CanaryRunError("no answer within 5s")
    now[0] = 125.0
    again, outcome = watch.round()
    assert again == findings and outcome is not None and outcome.result == "error"

    checker.answer = None
    path.write_bytes(encode_record(golden(tol=0.2)))  # a new record: checked at once
    os.utime(path, ns=(1, 1))
    assert watch.round()[0] == [] and checker.calls == 4

    path.write_bytes(encode_record(golden("m@2")))
    os.utime(path, ns=(2, 2))
    assert watch.round() == ([], None) and watch.record == golden(tol=0.2), (
        "another version's record is not used"
    )
    path.unlink()
    assert watch.round() == ([], None) and watch.record is None


def test_the_router_counts_canary_checks_and_drops_a_mismatching_replica() -> None:
    prom = CollectorRegistry()
    config = loopback_router_config(lease_s=600.0)
    with running_router(config, metrics_registry=prom):
        reg = p.Register("r1", "m", "http://127.0.0.1:1", node="n1", model_ref="m@1")
        agent = RegistryAgent(config.registry_bind, reg)
        try:
            agent.register()
            wait_for("the replica", lambda: len(list_replicas(config.routing_bind)) == 1)

            def count(stage: str, result: str) -> float:
                labels = {"model_ref": "m@1", "stage": stage, "result": result}
                return prom.get_sample_value("hpcserve_router_canary_checks_total", labels) or 0

            agent.send(p.CanaryReport("r1", "m@1", "pass", "before_register"))
            agent.send(p.CanaryReport("r1", "m@1", "pass"))
            agent.send(p.CanaryReport("r1", "m@1", "mismatch", detail="numerical canary ..."))
            wait_for("three checks counted", lambda: count("periodic", "mismatch") == 1)
            assert count("before_register", "pass") == 1 and count("periodic", "pass") == 1
            assert len(list_replicas(config.routing_bind)) == 1, "a count alone routes nothing"

            finding = Policy(HealthConfig()).finding(
                "numerical_canary", Mismatch(0, 3, "token 5, golden 6").detail()
            )
            agent.send(p.HealthReport("r1", [finding], node="n1"))
            wait_for("out of routing", lambda: not list_replicas(config.routing_bind))
            (event,) = list_health_events(config.routing_bind).events
            assert event.finding.detail == (
                "numerical canary mismatch at position 3 (prompt 0): token 5, golden 6"
            )
        finally:
            agent.close()
