"""The rollout loop (poolmgr/rollout_controller.py) and `hpcserve rollout` over a real model
registry and state file, with a fake clock and the gateways' counters given by the test."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.cli import main
from hpcserve.config import PlatformConfig, dump_config, parse_config
from hpcserve.modelcache.evaluations import Evaluation
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr import rollout as ro
from hpcserve.poolmgr.rollout_controller import RolloutController
from hpcserve.poolmgr.rollout_state import RolloutBook
from tests.routers import alias_registry

ALIAS = "extraction"


class World:
    """A config file, its registry (docs@1 and docs@2, extraction -> docs@1) and counters."""

    def __init__(self, root: Path) -> None:
        self.registry = alias_registry(root)
        self.config: PlatformConfig = parse_config({
            "state_dir": str(root / "state"),
            "registry": str(self.registry),
            "rollout": {"min_answers": 10, "check_s": 1},
        })  # fmt: skip
        self.config_path = root / "hpcserve.toml"
        self.config_path.write_text(dump_config(self.config))
        self.now = 1000.0
        self.answers: dict[str, dict[str, float]] = {"docs@1": {}, "docs@2": {}}
        self.readable = True

    def counters(self, models: object) -> dict[str, dict[str, float]]:
        from hpcserve.poolmgr.rollout_metrics import MetricsUnavailable

        if not self.readable:
            raise MetricsUnavailable("http://gw:8000/metrics: connection refused")
        flat = {
            ro.counter_key("gw", name, ref): value
            for ref, values in self.answers.items()
            for name, value in values.items()
        }
        return {ALIAS: flat}

    def answer(self, ref: str, answers: int, errors: int = 0) -> None:
        seen = self.answers[ref]
        seen["answers"] = seen.get("answers", 0) + answers
        seen["errors"] = seen.get("errors", 0) + errors

    def controller(self, metrics: CollectorRegistry | None = None) -> RolloutController:
        return RolloutController(
            self.config,
            metrics_registry=metrics,
            clock=lambda: self.now,
            read_counters=self.counters,
        )

    def cli(self, *argv: str) -> int:
        return main(["rollout", *argv, "--config", str(self.config_path)])

    def alias(self) -> tuple[str, str | None, int]:
        with Registry(self.registry) as reg:
            a = reg.alias(ALIAS)
        return a.target, a.canary, a.canary_percent

    def rollout(self) -> ro.Rollout:
        return RolloutBook(Path(self.config.state_dir)).read()[ALIAS]

    def pass_gate(self, ref: str) -> None:
        with Registry(self.registry) as reg:
            reg.record_evaluation(
                Evaluation(
                    ref=ref, suite="bol", suite_digest="0" * 64, suite_path="bol.jsonl", cases=1,
                    scores={"exact": 100.0}, key_metrics=["exact"], passed=True,
                )
            )  # fmt: skip


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_start_is_refused_for_a_version_that_has_not_passed_its_gate(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    assert world.cli("start", ALIAS, "docs@2") == 2
    assert "has no evaluation" in capsys.readouterr().err
    assert world.cli("start", ALIAS, "docs@2", "--force") == 2
    assert "--force needs --reason" in capsys.readouterr().err
    assert world.cli("start", ALIAS, "docs@2", "--steps", "1,50") == 2
    assert "the last step must be 100" in capsys.readouterr().err
    assert world.cli("start", ALIAS, "docs@1") == 2  # the target already
    assert not RolloutBook(Path(world.config.state_dir)).read()
    assert world.cli("start", ALIAS, "docs@2", "--force", "--reason", "hotfix") == 0
    assert "hotfix" in world.rollout().forced
    assert world.cli("start", ALIAS, "docs@2", "--force", "--reason", "again") == 2
    assert "abort it first" in capsys.readouterr().err


def test_a_rollout_steps_through_to_100_and_the_alias_follows(world: World) -> None:
    world.pass_gate("docs@2")
    assert world.cli("start", ALIAS, "docs@2", "--steps", "10,50,100", "--every", "1m") == 0
    metrics = CollectorRegistry()
    loop = world.controller(metrics)
    loop.check()
    assert world.alias() == ("docs@1", "docs@2", 10)
    assert metrics.get_sample_value("hpcserve_rollout_share_percent", {"alias": ALIAS}) == 10
    world.answer("docs@1", 90)
    world.answer("docs@2", 10)
    world.now += 30
    loop.check()
    assert world.rollout().step == 0 and "holding 10%" in world.rollout().note
    world.now += 30
    loop.check()
    assert world.alias() == ("docs@1", "docs@2", 50)
    world.answer("docs@2", 10)
    world.now += 60
    loop.check()
    assert world.alias() == ("docs@2", None, 0)
    assert world.rollout().state == ro.COMPLETED
    assert (
        metrics.get_sample_value("hpcserve_rollout_state", {"alias": ALIAS, "state": "completed"})
        == 1
    )
    with Registry(world.registry) as reg:  # every move left a line in the registry's audit
        assert [e.detail.split(";")[0] for e in reg.audit_log(ALIAS)][-3:] == [
            "share 10%",
            "share 50%",
            "share 100%",
        ]


def test_a_breach_rolls_back_at_once_with_its_reason(world: World) -> None:
    world.pass_gate("docs@2")
    assert world.cli("start", ALIAS, "docs@2", "--every", "10m") == 0
    metrics = CollectorRegistry()
    loop = world.controller(metrics)
    loop.check()
    world.answer("docs@1", 200, errors=1)
    world.answer("docs@2", 10, errors=4)
    world.now += 1
    loop.check()
    assert world.alias() == ("docs@1", None, 0)
    r = world.rollout()
    assert r.state == ro.ROLLED_BACK and r.reason.startswith("error rate 40.0% over stable 0.5%")
    assert metrics.get_sample_value("hpcserve_rollout_rollbacks_total", {"alias": ALIAS}) == 1


def test_a_restarted_pool_manager_goes_on_from_the_state_file(world: World) -> None:
    world.pass_gate("docs@2")
    assert world.cli("start", ALIAS, "docs@2", "--steps", "5,100", "--every", "60") == 0
    world.answer("docs@1", 100)
    world.controller().check()  # step 1 at 5%, its baseline taken
    world.answer("docs@2", 10)
    world.now += 30
    world.controller().check()  # another "process": half the hold
    assert world.rollout().step == 0
    world.now += 30
    world.controller().check()  # a third: the hold is over, counted from the first
    assert world.alias() == ("docs@2", None, 0)


def test_pause_resume_abort_and_unreadable_metrics(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.pass_gate("docs@2")
    assert world.cli("start", ALIAS, "docs@2", "--steps", "5,100", "--every", "60") == 0
    loop = world.controller()
    loop.check()
    assert world.cli("pause", ALIAS) == 0
    world.answer("docs@2", 50)
    world.now += 600
    loop.check()
    assert world.rollout().state == ro.PAUSED and world.alias()[2] == 5  # never advances
    assert world.cli("resume", ALIAS) == 0
    assert world.cli("resume", ALIAS) == 2  # not paused
    world.readable = False
    world.now += 600
    capsys.readouterr()
    loop.check()
    loop.check()
    assert world.rollout().step == 0  # nothing judged without the metrics
    assert capsys.readouterr().err.count("nothing judged until the gateways answer") == 1
    assert world.cli("abort", ALIAS, "--reason", "customer complaint") == 0
    assert world.alias() == ("docs@1", None, 0)  # at once, without the loop
    r = world.rollout()
    assert r.state == ro.ABORTED and "customer complaint" in r.reason
    assert world.cli("abort", ALIAS) == 2


def test_an_alias_changed_by_hand_aborts_the_rollout(world: World) -> None:
    world.pass_gate("docs@2")
    assert world.cli("start", ALIAS, "docs@2") == 0
    loop = world.controller()
    loop.check()
    with Registry(world.registry) as reg:
        reg.set_alias(ALIAS, "docs@1")  # an admin's own move
    loop.check()
    r = world.rollout()
    assert r.state == ro.ABORTED and "changed outside the rollout" in r.reason
    assert world.alias() == ("docs@1", None, 0)  # left as the admin set it


def test_status_prints_where_it_stands(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    assert world.cli("status") == 0
    assert "no rollouts" in capsys.readouterr().out
    world.pass_gate("docs@2")
    assert world.cli("start", ALIAS, "docs@2") == 0
    world.controller().check()
    capsys.readouterr()
    assert world.cli("status", ALIAS) == 0
    out = capsys.readouterr().out
    assert "rollout extraction: docs@2 over docs@1, holding at 1% (step 1 of 5)" in out
    assert world.cli("status", "--json") == 0
    assert '"share": 1' in capsys.readouterr().out
