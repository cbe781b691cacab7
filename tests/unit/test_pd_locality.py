"""The decode replica's locality across nodes (issue 22): Slurm's switch topology parsed
(`scontrol show topology`), read by the pool manager and handed to the router with its
ListReplicas, and the router's decode choice: same node, then same leaf switch, then any,
never onto an overloaded replica because it is near."""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Iterator

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from hpcserve.contracts import protocol as p
from hpcserve.poolmgr.switches import SwitchTopology
from hpcserve.router.policies.pd_roles import near_tier
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI, SlurmError
from hpcserve.slurm.parse import SlurmParseError, parse_scontrol_show_topology
from tests.routers import loopback_router_config

# --- the parser ------------------------------------------------------------------------------

# What Slurm 22.05 printed here for topology.conf "SwitchName=s1 Nodes=n[1-2]" and
# "SwitchName=top Switches=s1" (hpcserve/localslurm.py leaf_switch, checked by hand).
SEEN_22_05 = (
    "SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[1-2]\n"
    "SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-2] Switches=s1\n"
)
TWO_LEAVES = (
    "SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=gpu[001-003]\n"
    "SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=gpu[004-005],cpu1\n"
    "SwitchName=spine Level=1 LinkSpeed=1 Nodes=gpu[001-005],cpu1 Switches=leaf[1-2]\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SEEN_22_05, {"n1": "s1", "n2": "s1"}),
        (
            TWO_LEAVES,
            {
                "gpu001": "leaf1",
                "gpu002": "leaf1",
                "gpu003": "leaf1",
                "gpu004": "leaf2",
                "gpu005": "leaf2",
                "cpu1": "leaf2",
            },
        ),
        # no topology plugin: nothing on stdout (Slurm's note goes to stderr)
        ("", {}),
        ("No topology information available\n", {}),
        # without Level: a leaf is a switch with no switches below it
        (
            "SwitchName=a Nodes=x[1-2]\nSwitchName=b Nodes=x[1-2] Switches=a\n",
            {"x1": "a", "x2": "a"},
        ),
        ("SwitchName=a Level=0 Nodes=x1 Switches=(null)\n", {"x1": "a"}),
        # a node under two leaves (a config error of the site's): the first one
        (
            "SwitchName=a Level=0 Nodes=x1\nSwitchName=b Level=0 Nodes=x[1-2]\n",
            {"x1": "a", "x2": "b"},
        ),
        # a leaf without nodes, and topology/block's lines: no switch
        ("SwitchName=empty Level=0 LinkSpeed=1 Nodes=(null)\n", {}),
        ("BlockName=b1 BlockIndex=0 Nodes=n[1-4] BlockSize=4\n", {}),
        # leading blanks and extra fields of other releases
        (
            "  SwitchName=s9 Level=0 LinkSpeed=100 Nodes=z[01-02] Extra=1\n",
            {"z01": "s9", "z02": "s9"},
        ),
    ],
)
def test_scontrol_show_topology_gives_each_node_its_leaf_switch(text, expected):  # type: ignore[no-untyped-def]
    assert parse_scontrol_show_topology(text) == expected


@pytest.mark.parametrize(
    "text",
    ["SwitchName=s1 Level=0 Nodes=n[1-\n", "SwitchName=s1 Level=0 oops Nodes=n1\n"],
)
def test_an_unreadable_switch_line_is_an_error_quoting_it(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_scontrol_show_topology(text)


def _cli(rc: int, out: str, err: str) -> tuple[SlurmCLI, list[list[str]]]:
    seen: list[list[str]] = []

    def runner(argv: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        return subprocess.CompletedProcess(argv, rc, out, err)

    return SlurmCLI({}, runner=runner), seen


def test_the_client_asks_scontrol_once_and_reads_no_topology_as_none() -> None:
    client, seen = _cli(0, SEEN_22_05, "")
    assert client.topology() == {"n1": "s1", "n2": "s1"}
    assert seen == [["scontrol", "show", "topology"]]
    client, _ = _cli(0, "", "scontrol: error: No topology information available\n")
    assert client.topology() == {}
    client, _ = _cli(1, "", "slurm_load_topo error: Unable to contact slurm controller\n")
    with pytest.raises(SlurmError, match="Unable to contact"):
        client.topology()
    client, _ = _cli(0, "SwitchName=s1 Level=0 Nodes=n[\n", "")
    with pytest.raises(SlurmError, match="cannot read the switch topology"):
        client.topology()


# --- the pool manager's side -----------------------------------------------------------------


class Slurm:
    def __init__(self, answers: list[dict[str, str] | Exception]) -> None:
        self.answers = answers
        self.reads = 0

    def __call__(self) -> dict[str, str]:
        answer = self.answers[min(self.reads, len(self.answers) - 1)]
        self.reads += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_topology_goes_to_each_router_epoch_once_and_again_when_it_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s1 = {"n1": "s1", "n2": "s1"}
    s2 = {"n1": "s1", "n2": "s2"}
    slurm, failures = Slurm([s1, s1, SlurmError("down"), s2]), []
    topo = SwitchTopology(slurm, on_error=failures.append, refresh_s=600)
    with caplog.at_level(logging.INFO, logger="hpcserve.poolmgr.switches"):
        sent = topo.for_router(0)
        assert sent == s1 and slurm.reads == 1
        topo.answered(sent, "epoch-a")
        assert topo.for_router(5) is None  # the router has it
        topo.answered(None, "epoch-a")
        assert topo.for_router(10) is None and slurm.reads == 1  # read every 600 s only
        topo.answered(None, "epoch-b")  # the router restarted
        assert topo.for_router(15) == s1
        topo.answered(s1, "epoch-b")
        assert topo.for_router(700) is None and slurm.reads == 2  # re-read, unchanged
        assert topo.for_router(1400) is None and len(failures) == 1  # failed: kept
        assert topo.switches == s1
        assert topo.for_router(2100) == s2  # changed: sent again
    lines = [r.message for r in caplog.records]
    assert lines == [
        "switch topology: 2 nodes under 1 leaf switches",
        "switch topology: 2 nodes under 2 leaf switches",
    ]


def test_a_site_without_topology_tells_the_router_so_once() -> None:
    topo = SwitchTopology(Slurm([{}]), on_error=pytest.fail)
    assert topo.for_router(0) == {}
    topo.answered({}, "e")
    assert topo.for_router(1) is None


# --- the router's decode choice --------------------------------------------------------------


@pytest.mark.parametrize(
    ("tiers", "floor", "expected"),
    [
        # the node's replica is within overload_abs (8 here) of the least loaded: the node
        ([("same_node", [3]), ("same_switch", [3, 1])], 0, "same_node"),
        # the node's is overloaded: its switch, when one there is not
        ([("same_node", [20]), ("same_switch", [20, 5])], 0, "same_switch"),
        # the switch's are overloaded too: none (any replica)
        ([("same_node", [20]), ("same_switch", [20, 15])], 0, None),
        # no replica on the node: the switch
        ([("same_node", []), ("same_switch", [2])], 0, "same_switch"),
        # no switch known: one tier only, as before the topology
        ([("same_node", [9])], 0, None),
        ([("same_node", [9])], 2, "same_node"),
        # the bound is on the least loaded of a tier
        ([("same_node", [30, 8]), ("same_switch", [0])], 0, "same_node"),
    ],
)
def test_locality_decides_only_among_replicas_not_overloaded(tiers, floor, expected):  # type: ignore[no-untyped-def]
    got = near_tier(tiers, float, floor, overload_abs=8)
    assert (got[0] if got else None) == expected


@contextlib.contextmanager
def router(replicas: str, switches: dict[str, str] | None) -> Iterator[RouterServer]:
    """A router that never starts; `replicas`: "<role><node>" pairs (p prefill, d decode),
    e.g. "pa da db": r0 prefill on a, r1 decode on a, r2 decode on b. Its ListReplicas
    carried `switches` (the pool manager's)."""
    server = RouterServer(
        loopback_router_config(lease_s=600.0), metrics_registry=CollectorRegistry()
    )
    roles = {"p": "prefill", "d": "decode"}
    for i, (role, node) in enumerate(replicas.split()):
        server.registry.register(
            p.Register(f"r{i}", "m", f"http://u{i}", node=node, role=roles[role]), 0.0
        )
    listing = server._on_routing(p.encode(p.ListReplicas(1, node_switches=switches)))
    assert listing is not None
    try:
        yield server
    finally:
        server.kv_events.close()  # the one socket a router that never started holds


def busy(server: RouterServer, replica_id: str, waiting: int) -> None:
    """The router's load of a replica: its requests in flight plus those its engine queues."""
    server.registry.heartbeat(replica_id, p.ReplicaLoad(waiting=waiting), 0.0)


AB_S1 = {"a": "s1", "b": "s1", "c": "s2"}


@pytest.mark.parametrize(
    ("replicas", "switches", "loads", "decodes", "placement"),
    [
        # same node first
        ("pa da db dc", AB_S1, {}, {"r1"}, "same_node"),
        # no decode replica on the prefill's node: its switch, not the other switch
        ("pa db dc", AB_S1, {}, {"r1"}, "same_switch"),
        # the node's decode replica overloaded: the switch's
        ("pa da db dc", AB_S1, {"r1": 40}, {"r2"}, "same_switch"),
        # the switch's overloaded as well: the least loaded anywhere
        ("pa da db dc", AB_S1, {"r1": 40, "r2": 40}, {"r3"}, "other_node"),
        # no topology: by node, then any (as before)
        ("pa db dc", None, {"r1": 3}, {"r2"}, "other_node"),
        ("pa db dc", {}, {"r1": 3}, {"r2"}, "other_node"),
        # a prefill node the topology does not name: by node, then any
        ("px db dc", AB_S1, {"r1": 3}, {"r2"}, "other_node"),
    ],
)
def test_the_decode_replica_is_on_the_node_then_the_switch_then_anywhere(
    replicas, switches, loads, decodes, placement
):  # type: ignore[no-untyped-def]
    with router(replicas, switches) as server:
        for replica_id, waiting in loads.items():
            busy(server, replica_id, waiting)
        reply = server.route(p.Route(1, "m"))
        assert reply.prefill_replica_id == "r0"
        assert reply.replica_id in decodes
        assert server.metrics.pd_routes.labels(placement)._value.get() == 1


def test_the_router_keeps_the_topology_a_listing_without_it_does_not_change() -> None:
    with router("pa db", AB_S1) as server:
        raw = server._on_routing(p.encode(p.ListReplicas(2)))  # a gateway's, a CLI's
        assert raw is not None
        listing = p.routing_reply_decoder.decode(raw)
        assert isinstance(listing, p.ReplicaList)
        assert {r.replica_id: r.switch for r in listing.replicas} == {"r0": "s1", "r1": "s1"}
        server._on_routing(p.encode(p.ListReplicas(3, node_switches={})))  # none any more
        assert server.node_switches == {}


def test_older_peers_read_the_new_fields() -> None:
    class OldListReplicas(msgspec.Struct, frozen=True, tag="list_replicas"):
        request_id: int

    new = p.ListReplicas(1, node_switches={"a": "s1"})
    assert msgspec.msgpack.decode(p.encode(new), type=OldListReplicas).request_id == 1
    assert p.routing_message_decoder.decode(p.encode(OldListReplicas(2))) == p.ListReplicas(2)
