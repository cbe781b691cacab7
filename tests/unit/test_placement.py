"""poolmgr/placement.py: pin new replicas to nodes whose cache holds the model, only where
they can start now."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from hpcserve.config import PlatformConfig, parse_config
from hpcserve.poolmgr.identity import new_identity
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.placement import (
    CacheInventory,
    PinWatch,
    gpu_count,
    job_pins,
    pin_wait,
    placements,
    unavailable_pin,
)
from hpcserve.poolmgr.spec import pool_spec_digest
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import (
    JobState,
    SlurmJob,
    SlurmNode,
    SqueueSnapshot,
    unavailable_required_nodes,
    waits_for_nodes,
)

RECORDED = Path(__file__).parent / "data" / "slurm" / "22.05"


def node(
    name: str,
    used: int = 0,
    *,
    total: int = 4,
    state: tuple[str, ...] = ("MIXED",),
    partitions: tuple[str, ...] = ("gpu",),
) -> SlurmNode:
    return SlurmNode(
        name=name,
        state=list(state),
        reason="",
        gres=f"gpu:{total}",
        gres_used=f"gpu:{used}",
        cpus=8,
        alloc_cpus=used,
        partitions=list(partitions),
    )


@pytest.mark.parametrize(
    ("gres", "count"),
    [
        ("gpu:4", 4),
        ("gpu:a100:4", 4),
        ("gpu:1(IDX:0)", 1),
        ("gpu:a100:2(IDX:0-1),gpu:h100:2(IDX:2-3)", 4),
        ("", 0),
        ("(null)", 0),
    ],
)
def test_gpu_count(gres: str, count: int) -> None:
    assert gpu_count(gres) == count


def test_jobs_go_to_holders_with_room_most_room_first_then_unpinned() -> None:
    nodes = [node("n1", used=3), node("n2", used=1), node("n3", used=0)]
    assert placements(["n1", "n2"], nodes, jobs=5, gpus_per_job=1) == [
        "n2", "n2", "n1", "n2", "",
    ]  # fmt: skip
    assert placements(["n1", "n2"], nodes, jobs=1, gpus_per_job=2) == ["n2"]
    assert placements(["n1"], nodes, jobs=1, gpus_per_job=2) == [""]


def test_free_cpus_bound_the_jobs_a_holder_takes() -> None:
    small = SlurmNode("n1", ["MIXED"], "", "gpu:4", "gpu:1", cpus=2, alloc_cpus=1, partitions=[])
    assert placements(["n1"], [small], jobs=2, gpus_per_job=1) == ["n1", ""]


@pytest.mark.parametrize(
    "bad",
    [
        node("n1", state=("IDLE", "DRAIN")),
        node("n1", state=("DOWN",)),
        node("n1", partitions=("cpu",)),
        node("n1", used=4),
    ],
)
def test_no_pin_to_a_holder_that_cannot_start_the_job(bad: SlurmNode) -> None:
    assert placements(["n1"], [bad], jobs=1, gpus_per_job=1, partition="gpu") == [""]


def test_cpu_only_jobs_need_a_free_cpu() -> None:
    full = SlurmNode("n1", ["ALLOCATED"], "", "", "", cpus=8, alloc_cpus=8, partitions=["c"])
    some = SlurmNode("n2", ["MIXED"], "", "", "", cpus=8, alloc_cpus=2, partitions=["c"])
    assert placements(["n1", "n2"], [full, some], jobs=2, gpus_per_job=0) == ["n2", "n2"]


def test_inventory_keeps_the_last_report_per_node_and_ignores_empty_ones() -> None:
    inv = CacheInventory()
    inv.report("n1", ["m@1-aaaaaaaaaaaa"])
    inv.report("n2", ["m@1-aaaaaaaaaaaa", "x@2-bbbbbbbbbbbb"])
    inv.report("n1", [])  # an engine without a node cache: nothing learnt
    inv.report("", ["m@1-aaaaaaaaaaaa"])  # no node name: ignored
    assert inv.holders("m@1-aaaaaaaaaaaa") == ["n1", "n2"]
    inv.report("n1", ["x@2-bbbbbbbbbbbb"])  # m evicted on n1
    assert inv.holders("m@1-aaaaaaaaaaaa") == ["n2"]


def test_job_pins_only_for_registry_models_on_one_node_not_chosen_by_the_pool() -> None:
    inv = CacheInventory({"n1": {"m@1-aaaaaaaaaaaa"}})
    nodes = [node("n1")]
    key = "m@1-aaaaaaaaaaaa"
    assert job_pins(inv, key, nodes, jobs=2, gpus_per_job=1) == ["n1", "n1"]
    assert job_pins(inv, "", nodes, jobs=1, gpus_per_job=1) == [""]
    assert job_pins(inv, key, nodes, jobs=1, gpus_per_job=1, nodes_per_job=2) == [""]
    for args in (["--nodelist=n3"], ["-w", "n3"], ["--exclude=n1"]):
        assert job_pins(inv, key, nodes, jobs=1, gpus_per_job=1, sbatch_args=args) == [""]


# -- a pinned job whose node goes away after submission


@pytest.mark.parametrize(
    ("reason", "description", "nodes"),
    [
        ("ReqNodeNotAvail", "ReqNodeNotAvail, UnavailableNodes:n2", ["n2"]),
        (
            "ReqNodeNotAvail",
            "ReqNodeNotAvail, UnavailableNodes:gpu[01-02],n5",
            ["gpu01", "gpu02", "n5"],
        ),
        ("ReqNodeNotAvail", "ReqNodeNotAvail, UnavailableNodes:", []),
        ("ReqNodeNotAvail", "", []),
        (
            "Resources",
            "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority "
            "partitions",
            [],
        ),
        ("Resources", "", None),
        ("Priority", "", None),
        ("JobHeldUser", "", None),
        ("None", "", None),
    ],
)
def test_unavailable_required_nodes(reason: str, description: str, nodes: list[str] | None) -> None:
    assert unavailable_required_nodes(reason, description) == nodes


class Runner:
    def __init__(self, stdout: str) -> None:
        self.stdout = stdout

    def __call__(self, argv: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        assert argv == ["squeue", "--all", "--json"]
        return subprocess.CompletedProcess(argv, 0, self.stdout, "")


def recorded_jobs(name: str) -> dict[int, SlurmJob]:
    """squeue --json recorded on 22.05.8: job 1 ran on n2 and was cancelled, job 2 was
    submitted with --nodelist=n2 while job 1 held n2's GPUs, then n2 was drained (the
    `down` file: job 3 pinned to n1, then n1 set down)."""
    cli = SlurmCLI({}, runner=Runner((RECORDED / name).read_text()))
    return {job.job_id: job for job in cli.jobs().jobs}


def test_a_job_pinned_to_a_drained_node_is_seen_from_squeue_alone() -> None:
    job = recorded_jobs("squeue_pinned_node_drained.json")[2]
    assert (job.state, job.required_nodes, job.state_reason) == (
        JobState.PENDING,
        ["n2"],
        "ReqNodeNotAvail",
    )
    assert job.state_description == "ReqNodeNotAvail, UnavailableNodes:n2"
    assert unavailable_pin(job, []) == ["n2"]  # no node listing yet: the reason says it
    assert unavailable_pin(job, [node("n1"), node("n2", state=("IDLE", "DRAIN"))]) == ["n2"]
    ran = recorded_jobs("squeue_pinned_node_drained.json")[1]
    assert ran.required_nodes == ["n2"] and unavailable_pin(ran, []) == []  # not pending


def test_a_job_pinned_to_a_node_set_down_before_slurm_names_it() -> None:
    job = recorded_jobs("squeue_pinned_node_down.json")[3]
    assert (job.state_reason, job.required_nodes) == ("Resources", ["n1"])
    assert unavailable_pin(job, [node("n1", state=("DOWN",)), node("n2")]) == ["n1"]


def pending(job_id: int, pinned: Sequence[str], reason: str = "Resources") -> SlurmJob:
    return SlurmJob(
        job_id, "hpcserve-chat", JobState.PENDING, reason, [], "gpu", "", 0, None, None, None,
        "", required_nodes=list(pinned),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("job", "nodes", "bad"),
    [
        (pending(1, ["n2"]), [node("n1"), node("n2")], []),  # busy, not gone: it waits
        (pending(1, []), [node("n2", state=("DOWN",))], []),  # not pinned
        (pending(1, ["n2"]), [node("n1")], ["n2"]),  # gone from the listing
        (pending(1, ["n2"]), [node("n2", state=("IDLE", "DRAIN"))], ["n2"]),
        (pending(1, ["n2"]), [node("n2", state=("DOWN", "NOT_RESPONDING"))], ["n2"]),
    ],
)
def test_unavailable_pin(job: SlurmJob, nodes: list[SlurmNode], bad: list[str]) -> None:
    assert unavailable_pin(job, nodes) == bad


def test_pin_watch_reports_a_job_stranded_for_the_whole_wait() -> None:
    watch = PinWatch(wait_s=60)
    drained = [node("n1"), node("n2", state=("IDLE", "DRAIN"))]
    up = [node("n1"), node("n2")]
    job = pending(7, ["n2"], reason="BeginTime")  # not waiting for nodes: only drained counts
    assert watch.stranded([job], drained, now=0) == {}
    assert watch.stranded([job], drained, now=59) == {}
    assert watch.stranded([job], up, now=60) == {}  # back: the wait starts over
    assert watch.stranded([job], drained, now=61) == {}
    assert watch.stranded([job], drained, now=121) == {7: ["n2"]}
    assert watch.stranded([], drained, now=122) == {} and watch.since == {}


class FakeSlurm:
    """The SlurmClient calls one poll makes, answered from lists."""

    def __init__(self, jobs: list[SlurmJob], nodes: list[SlurmNode]) -> None:
        self.job_list, self.node_list = jobs, nodes
        self.submitted: list[list[str]] = []
        self.cancelled: list[int] = []

    def submit(self, script: str, *, extra_args: Sequence[str] = ()) -> int:
        self.submitted.append(list(extra_args))
        return 100 + len(self.submitted)

    def jobs(self, *, name_prefix: str | None = None) -> SqueueSnapshot:
        return SqueueSnapshot("22.05.8", list(self.job_list))

    def cancel(
        self, job_ids: Sequence[int], *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        self.cancelled += job_ids

    def nodes(self) -> list[SlurmNode]:
        return list(self.node_list)


def pinned_pool(tmp_path: Path) -> tuple[PlatformConfig, str]:
    """A sim pool "chat" with a 60 s pin wait, and the comment its jobs carry."""
    config = parse_config(
        {
            "state_dir": str(tmp_path / "state"),
            "poolmgr": {"pin_wait_s": 60},
            "pools": [{"name": "chat", "model_path": str(tmp_path / "m"), "engine": "sim"}],
        }
    )
    pool = config.pools[0]
    return config, new_identity("chat", pool.model, spec=pool_spec_digest(config, pool)).comment()


def test_the_pool_manager_replaces_a_stranded_pinned_job_unpinned(tmp_path: Path) -> None:
    config, comment = pinned_pool(tmp_path)
    job = SlurmJob(
        42, "hpcserve-chat", JobState.PENDING, "ReqNodeNotAvail", [], "gpu", comment, 0, None,
        None, None, "", required_nodes=["n2"],
        state_description="ReqNodeNotAvail, UnavailableNodes:n2",
    )  # fmt: skip
    slurm = FakeSlurm([job], [node("n1"), node("n2", state=("IDLE", "DRAIN"))])
    clock = [1000.0]
    manager = PoolManager(config, slurm, clock=lambda: clock[0], router_endpoint=None)
    manager.poll_once()
    assert (slurm.cancelled, slurm.submitted) == ([], [])  # within the wait
    clock[0] += 61
    manager.poll_once()
    assert slurm.cancelled == [42]
    assert len(slurm.submitted) == 1 and not any("--nodelist" in a for a in slurm.submitted[0])


# -- a pinned job that loses the race for its node while the node is up


@pytest.mark.parametrize(
    ("reason", "description", "waits"),
    [
        ("Resources", "", True),  # the node's GPUs went to another job first
        ("Priority", "", True),  # jobs ahead of it will take them
        ("ReqNodeNotAvail", "ReqNodeNotAvail, UnavailableNodes:n2", True),
        ("Resources", "Nodes required for job are DOWN, DRAINED or reserved for jobs in", True),
        ("BeginTime", "", False),
        ("Dependency", "", False),
        ("JobHeldUser", "", False),
        ("JobHeldAdmin", "", False),
        ("QOSMaxGRESPerUser", "", False),
        ("AssocGrpGRES", "", False),
        ("None", "", False),  # not looked at by the scheduler yet
        ("", "", False),
    ],
)
def test_waits_for_nodes(reason: str, description: str, waits: bool) -> None:
    assert waits_for_nodes(reason, description) is waits


@pytest.mark.parametrize(
    ("job", "nodes", "waits_for"),
    [
        (pending(1, ["n2"]), [node("n1"), node("n2", 4)], ["n2"]),  # up, busy: lost the race
        (pending(1, ["n2"], "Priority"), [node("n2")], ["n2"]),
        (pending(1, ["n2"], "BeginTime"), [node("n2", 4)], []),  # would wait unpinned too
        (pending(1, ["n2"], "JobHeldUser"), [node("n2")], []),
        (pending(1, ["n2"], "None"), [node("n2")], []),
        (pending(1, ["n2"], "BeginTime"), [node("n2", state=("DOWN",))], ["n2"]),
        (pending(1, [], "Resources"), [node("n2", 4)], []),  # not pinned
    ],
)
def test_pin_wait(job: SlurmJob, nodes: list[SlurmNode], waits_for: list[str]) -> None:
    assert pin_wait(job, nodes) == waits_for


def test_pin_watch_reports_a_job_that_lost_the_race_and_avoids_its_node() -> None:
    watch = PinWatch(wait_s=60)
    busy = [node("n1"), node("n2", 4)]
    job = pending(7, ["n2"], "Resources")
    assert watch.stranded([job], busy, now=0) == {} and watch.avoided(0) == set()
    assert watch.stranded([msgspec.structs.replace(job, state_reason="None")], busy, now=30) == {}
    assert watch.stranded([job], busy, now=31) == {}  # the wait started over at 30
    assert watch.stranded([job], busy, now=91) == {7: ["n2"]}
    assert watch.avoided(now=151) == {"n2"} and watch.avoided(now=152) == set()


def test_placement_never_pins_to_an_avoided_node() -> None:
    inv = CacheInventory()
    inv.report("n1", ["m@1-abc"])
    inv.report("n2", ["m@1-abc"])
    nodes = [node("n1"), node("n2")]
    assert job_pins(inv, "m@1-abc", nodes, jobs=2, gpus_per_job=1) == ["n1", "n2"]
    assert job_pins(inv, "m@1-abc", nodes, jobs=2, gpus_per_job=1, avoid={"n1"}) == ["n2", "n2"]
    assert placements(["n2"], nodes, jobs=1, gpus_per_job=1, avoid=["n2"]) == [""]


def test_the_pool_manager_replaces_a_pinned_job_that_lost_its_node_unpinned(
    tmp_path: Path,
) -> None:
    """n2 is up and has room by its GRES, yet the job waits (Slurm says Priority): after
    the wait it is replaced unpinned, and n2 is avoided for the next wait."""
    config, comment = pinned_pool(tmp_path)
    job = SlurmJob(
        42, "hpcserve-chat", JobState.PENDING, "Priority", [], "gpu", comment, 0, None,
        None, None, "", required_nodes=["n2"],
    )  # fmt: skip
    slurm = FakeSlurm([job], [node("n1", 4), node("n2")])
    clock = [1000.0]
    manager = PoolManager(config, slurm, clock=lambda: clock[0], router_endpoint=None)
    manager.poll_once()
    assert (slurm.cancelled, slurm.submitted) == ([], [])
    clock[0] += 60
    manager.poll_once()
    assert slurm.cancelled == [42]
    assert manager.pin_watch.avoided(clock[0]) == {"n2"}
    assert len(slurm.submitted) == 1 and not any("--nodelist" in a for a in slurm.submitted[0])
