"""poolmgr/placement.py: pin new replicas to nodes whose cache holds the model, only where
they can start now."""

from __future__ import annotations

import pytest

from hpcserve.poolmgr.placement import CacheInventory, gpu_count, job_pins, placements
from hpcserve.poolmgr.slurm_parse import SlurmNode


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
