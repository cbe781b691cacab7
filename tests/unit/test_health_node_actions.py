"""The pool manager's node actions on health events: drain with a readable reason, never
touch a node that is already drained, run the reset hook, acknowledge only what was done."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from hpcserve.config import HealthConfig
from hpcserve.contracts import protocol as p
from hpcserve.health.node_actions import NodeHealthActions, hook_argv
from hpcserve.health.policy import Policy
from hpcserve.slurm.client import SlurmError
from hpcserve.slurm.parse import SlurmNode

POLICY = Policy(HealthConfig(xid_actions={"79": "drain_reset"}, reset_hook=["reset", "{node}"]))


def node(name: str, state: Sequence[str] = ("IDLE",), reason: str = "") -> SlurmNode:
    return SlurmNode(name, list(state), reason, "gpu:4", "", 2, 0, ["gpu"])


class FakeSlurm:
    def __init__(self, nodes: list[SlurmNode]) -> None:
        self._nodes = {n.name: n for n in nodes}
        self.drained: list[tuple[str, str]] = []
        self.fail = False

    def nodes(self) -> list[SlurmNode]:
        return list(self._nodes.values())

    def drain_node(self, name: str, reason: str) -> None:
        if self.fail:
            raise SlurmError("scontrol failed")
        self.drained.append((name, reason))
        self._nodes[name] = node(name, ("MIXED", "DRAIN"), reason)


class Router:
    epoch = "e1"

    def __init__(self) -> None:
        self.events: list[p.HealthEvent] = []
        self.asked: list[tuple[str, int]] = []

    def add(self, node_name: str, job: int, finding: p.HealthFinding) -> None:
        seq = len(self.events) + 1
        self.events.append(p.HealthEvent(seq, 0.0, f"r{job}", node_name, job, "p", finding))

    def fetch(self, endpoint: str, epoch: str, ack: int) -> p.HealthEvents:
        self.asked.append((epoch, ack))
        if epoch == self.epoch:
            self.events = [e for e in self.events if e.seq > ack]
        return p.HealthEvents(1, self.epoch, list(self.events))


def make(slurm: FakeSlurm, router: Router) -> tuple[NodeHealthActions, list[list[str]]]:
    hooks: list[list[str]] = []

    def run_hook(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        hooks.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    actions = NodeHealthActions(slurm, CollectorRegistry(), fetch=router.fetch, run_hook=run_hook)
    return actions, hooks


def test_drains_the_node_with_the_reason_and_runs_the_reset_hook() -> None:
    slurm, router = FakeSlurm([node("n1"), node("n2")]), Router()
    actions, hooks = make(slurm, router)
    router.add("n1", 11, POLICY.finding("temperature", "temperature 95C gpu 0"))
    router.add("n1", 11, POLICY.xid_finding(79, 3))
    router.add("n1", 12, POLICY.xid_finding(48, 1))
    assert actions.poll("tcp://x", POLICY.config) == {11, 12}
    assert slurm.drained == [("n1", "hpcserve: xid 79 gpu 3; xid 48 gpu 1")]
    assert hooks == [["reset", "n1"]]
    assert actions.actions.labels("drain")._value.get() == 1
    assert actions.actions.labels("reset_hook")._value.get() == 1
    assert actions.events.labels("temperature", "log")._value.get() == 1
    # Acknowledged: the next poll gets nothing new and does nothing.
    assert actions.poll("tcp://x", POLICY.config) == set()
    assert router.asked[-1] == ("e1", 3) and len(slurm.drained) == 1


def test_a_node_an_admin_drained_keeps_its_reason() -> None:
    slurm = FakeSlurm([node("n1", ("IDLE", "DRAIN"), "bad DIMM, ticket 42")])
    router = Router()
    actions, hooks = make(slurm, router)
    router.add("n1", 11, POLICY.xid_finding(79, 3))
    assert actions.poll("tcp://x", POLICY.config) == {11}
    assert slurm.drained == [] and hooks == []
    assert actions.actions.labels("already_drained")._value.get() == 1


def test_a_slurm_error_leaves_the_events_for_the_next_poll() -> None:
    slurm, router = FakeSlurm([node("n1")]), Router()
    actions, _ = make(slurm, router)
    router.add("n1", 11, POLICY.xid_finding(48, 0))
    slurm.fail = True
    actions.poll("tcp://x", POLICY.config)
    assert slurm.drained == [] and actions.actions.labels("drain_failed")._value.get() == 1
    slurm.fail = False
    actions.poll("tcp://x", POLICY.config)
    assert slurm.drained == [("n1", "hpcserve: xid 48 gpu 0")]


def test_a_router_restart_starts_the_count_again() -> None:
    slurm, router = FakeSlurm([node("n1"), node("n2")]), Router()
    actions, _ = make(slurm, router)
    router.add("n1", 11, POLICY.xid_finding(48, 0))
    actions.poll("tcp://x", POLICY.config)
    router.epoch, router.events = "e2", []
    router.add("n2", 21, POLICY.xid_finding(48, 0))
    actions.poll("tcp://x", POLICY.config)
    assert [name for name, _ in slurm.drained] == ["n1", "n2"]


def test_hook_argv() -> None:
    assert hook_argv(["/sbin/gpu-reset", "--node={node}", "{reason}"], "n1", "hpcserve: x") == [
        "/sbin/gpu-reset",
        "--node=n1",
        "hpcserve: x",
    ]
