"""The router's side of health, over real ZeroMQ: a HealthReport takes the replica out of
routing at once (stop_routing or worse), and the findings wait for the pool manager."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hpcserve.contracts import protocol as p
from hpcserve.contracts.router_client import list_health_events, list_replicas
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.health.policy import Policy
from hpcserve.router.health_events import HealthEventLog
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.routers import loopback_router_config, running_router

POLICY = Policy()


@pytest.fixture
def router() -> Iterator[RouterServer]:
    """A lease no test here outlives, however long this process is descheduled: a replica
    leaves routing by message only."""
    with running_router(loopback_router_config(lease_s=600.0)) as server:
        yield server


def registration(replica_id: str) -> p.Register:
    return p.Register(replica_id, "m", "http://127.0.0.1:1", pool="p", slurm_job_id=7, node="n1")


def report(replica_id: str, *findings: p.HealthFinding) -> p.HealthReport:
    return p.HealthReport(replica_id, list(findings), node="n1", slurm_job_id=7, pool="p")


def test_event_log_forgets_what_was_acknowledged() -> None:
    log = HealthEventLog(limit=3)
    log.add(report("a", POLICY.xid_finding(79, 3), POLICY.xid_finding(48, 1)), at=1.0)
    events = log.since("", 0)
    assert [e.seq for e in events] == [1, 2]
    assert events[0].finding.detail == "xid 79 gpu 3" and events[0].node == "n1"
    assert [e.seq for e in log.since("another-epoch", 2)] == [1, 2], "a stale epoch acks nothing"
    assert [e.seq for e in log.since(log.epoch, 1)] == [2]
    log.add(report("a", *[POLICY.xid_finding(13, i) for i in range(3)]), at=2.0)
    assert [e.seq for e in log.since(log.epoch, 0)] == [3, 4, 5] and log.dropped == 1


def test_a_health_report_takes_the_replica_out_of_routing(router: RouterServer) -> None:
    agents = {rid: RegistryAgent(router.config.registry_bind, registration(rid)) for rid in "ab"}
    try:
        for agent in agents.values():
            agent.register()
        wait_for("two replicas", lambda: len(list_replicas(router.config.routing_bind)) == 2)

        # Log-only: the replica stays.
        agents["a"].send(report("a", POLICY.finding("temperature", "temperature 95C gpu 0")))
        # A node fault: it leaves at once.
        agents["b"].send(report("b", POLICY.xid_finding(79, 3)))
        wait_for(
            "replica b gone",
            lambda: [r.replica_id for r in list_replicas(router.config.routing_bind)] == ["a"],
        )
        assert router.metrics.lease_expiries._value.get() == 0, "by message, not by lease"

        events = list_health_events(router.config.routing_bind)
        assert [(e.replica_id, e.finding.detail, e.slurm_job_id) for e in events.events] == [
            ("a", "temperature 95C gpu 0", 7),
            ("b", "xid 79 gpu 3", 7),
        ]
        after = list_health_events(router.config.routing_bind, events.epoch, events.events[-1].seq)
        assert after.events == [] and after.epoch == events.epoch

        metrics = router.metrics.health_findings
        assert metrics.labels("xid", "drain")._value.get() == 1
        assert metrics.labels("temperature", "log")._value.get() == 1
    finally:
        for agent in agents.values():
            agent.close()


def test_health_messages_round_trip_and_their_tags_are_unique() -> None:
    finding = POLICY.xid_finding(79, 3)
    msg = report("r1", finding)
    assert p.registry_message_decoder.decode(p.encode(msg)) == msg
    ask = p.ListHealthEvents(5, "e1", 3)
    assert p.routing_message_decoder.decode(p.encode(ask)) == ask
    events = p.HealthEvents(5, "e1", [p.HealthEvent(4, 1.5, "r1", "n1", 7, "p", finding)])
    assert p.routing_reply_decoder.decode(p.encode(events)) == events
    tags = [
        cls.__struct_config__.tag
        for cls in vars(p).values()
        if isinstance(cls, type)
        and issubclass(cls, p.msgspec.Struct)
        and cls.__struct_config__.tag is not None
    ]
    assert len(tags) == len(set(tags)) and "health_report" in tags
