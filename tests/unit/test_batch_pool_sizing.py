"""Elastic batch pools: the sizing rule as a table, the backlog read from a real batch
store, the idle room on Slurm's nodes, the config checks, and the pool manager's whole
decision over a poll (real reconcile, recorded node states)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import ConfigError, parse_config
from hpcserve.contracts.batch_backlog import read_backlog
from hpcserve.gateway.batch.store import BatchRecord, BatchStore, new_id
from hpcserve.gateway.batch.validate import validate_batch_file
from hpcserve.poolmgr.batch_pools import BatchPools, adapter_backlog
from hpcserve.poolmgr.batch_sizing import BatchPoolView, batch_pool_size
from hpcserve.poolmgr.placement import free_room
from hpcserve.poolmgr.reconcile import ObservedJob
from hpcserve.poolmgr.spec import build_job_spec, pool_spec_digest
from hpcserve.slurm.parse import SlurmNode

BASE = BatchPoolView(
    floor=1, ceiling=4, backlog=0, per_replica=100, running=1, pending=0, room=0,
    interactive_pending=False, interactive_waited_s=0, yield_after_s=30, draining=0, current=1,
    idle_for_s=math.inf, scale_down_after_s=60,
)  # fmt: skip
WAITS = {"interactive_pending": True, "interactive_waited_s": 30}


@pytest.mark.parametrize(
    ("change", "size"),
    [
        ({}, 1),  # nothing waits: the floor
        ({"backlog": 250, "room": 8}, 3),  # a replica per 100 requests, room for them
        ({"backlog": 10_000, "room": 8}, 4),  # never past the ceiling
        ({"backlog": 250, "room": 1}, 2),  # only into idle GPUs
        ({"backlog": 250, "room": 0}, 1),  # a full cluster: stays
        ({"backlog": 250, "room": 8, "pending": 1}, 2),  # its own job waits: no more
        ({"backlog": 250, "room": 8, "interactive_pending": True}, 1),  # interactive first
        ({"backlog": 250, "running": 3, "current": 3}, 3),  # grown: keeps what runs
        ({"backlog": 50, "running": 3, "current": 3}, 1),  # a smaller backlog: fewer
        ({"running": 3, "current": 3, "idle_for_s": 10}, 3),  # just drained: holds
        ({"running": 3, "current": 3, "idle_for_s": 60}, 1),  # idle long enough: floor
        ({"backlog": 250, "running": 0, "current": 3}, 1),  # preempted: no resubmission
        ({"running": 0, "current": 3, "idle_for_s": 10}, 1),  # ... holding nothing gone
        ({"floor": 0, "running": 0, "current": 0}, 0),  # a floor of 0
        ({"floor": 0, "running": 0, "current": 0, "backlog": 1, "room": 1}, 1),
        ({"floor": 2, "running": 0, "current": 2, "backlog": 1}, 2),  # the floor stays
        # An interactive job waited yield_after_s: one replica drains, then the next.
        ({"backlog": 500, "running": 3, "current": 3, **WAITS}, 2),
        ({"backlog": 500, "running": 2, "current": 2, "draining": 1, **WAITS}, 2),
        ({"backlog": 500, "running": 2, "pending": 1, "current": 3, **WAITS}, 1),
        ({"backlog": 500, "running": 1, "current": 1, **WAITS}, 1),  # never below the floor
        ({"backlog": 500, "running": 3, "current": 3, **WAITS, "interactive_waited_s": 5}, 3),
        ({"running": 3, "current": 3, **WAITS}, 1),  # no backlog: straight to the floor
    ],
)
def test_batch_pool_size(change: dict[str, object], size: int) -> None:
    assert batch_pool_size(dataclasses.replace(BASE, **change)).replicas == size  # type: ignore[arg-type]


def test_the_reason_says_what_held_the_pool_back() -> None:
    held = batch_pool_size(dataclasses.replace(BASE, backlog=250, interactive_pending=True))
    assert held.reason == (
        "batch backlog 250 requests wants 3, an interactive pool's job is pending"
    )


def _add_batch(store: BatchStore, models: list[str], *, status: str, done: int = 0) -> None:
    data = b"".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": "p"}}).encode() + b"\n"
        for i, model in enumerate(models)
    )  # fmt: skip
    temp = store.temp_path()
    temp.write_bytes(data)
    summary = validate_batch_file([data], max_lines=1000)
    file = store.add_file(temp, tenant="t", filename="in", purpose="batch", summary=summary)
    store.create_batch(
        BatchRecord(
            id=new_id("batch_"), tenant="t", endpoint="/v1/completions",
            input_file_id=file.id, completion_window="24h", status=status, created_at=1,
            expires_at=2, total=len(models), completed=done,
            model=models[0] if len(set(models)) == 1 else None,
        )
    )  # fmt: skip


def test_backlog_counts_unanswered_lines_of_running_batches_per_model(tmp_path: Path) -> None:
    assert read_backlog(tmp_path / "none") == {}
    store = BatchStore(tmp_path)
    _add_batch(store, ["a"] * 5, status="in_progress", done=2)
    _add_batch(store, ["a"] * 4, status="validating")
    _add_batch(store, ["a", "b", "b"], status="in_progress")  # counted against both models
    _add_batch(store, ["a"] * 7, status="completed", done=7)
    _add_batch(store, ["b"] * 7, status="cancelling")  # what never ran will not run
    store.close()
    assert read_backlog(tmp_path) == {"a": 3 + 4 + 3, "b": 3}


def node(name: str, used: int, *, state: str = "MIXED", parts: tuple[str, ...] = ("gpu",)):  # type: ignore[no-untyped-def]
    return SlurmNode(
        name=name, state=[state], reason="", gres="gpu:4", gres_used=f"gpu:{used}", cpus=8,
        alloc_cpus=used, partitions=list(parts),
    )  # fmt: skip


def test_free_room_counts_jobs_of_the_shape_on_usable_nodes_of_the_partition() -> None:
    nodes = [node("n1", 1), node("n2", 0), node("n3", 0, state="DOWN"), node("n4", 0, parts=())]
    assert free_room(nodes, gpus_per_job=1, partition="gpu") == 3 + 4
    assert free_room(nodes, gpus_per_job=4, partition="gpu") == 1
    assert free_room(nodes, gpus_per_job=2, nodes_per_job=2, partition="gpu") == 1
    assert free_room(nodes, gpus_per_job=4) == 2  # no partition: every usable node


def _config(pool: dict[str, object], **slurm: object):  # type: ignore[no-untyped-def]
    return parse_config({
        "slurm": {"partition": "gpu", **slurm},
        "pools": [{"name": "chat", "model_path": "/m"},
                  {"name": "bulk", "model_path": "/m", "served_model_name": "chat",
                   "role": "batch", **pool}],
    })  # fmt: skip


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"max_replicas": 2, "role": "interactive", "served_model_name": "other"},
         "pools[1].max_replicas: only a batch pool (role = 'batch') grows with its backlog"),
        ({"replicas": 3, "max_replicas": 2},
         "pools[1].max_replicas: 2 is below replicas (3), the pool's floor"),
        ({"backlog_per_replica": 0}, "pools[1].backlog_per_replica: expected int >= 1, got 0"),
        ({"scale_down_after_s": -1}, "pools[1].scale_down_after_s: expected float >= 0"),
    ],
)  # fmt: skip
def test_elastic_keys_are_checked_at_start(pool: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(pool)
    assert message in str(caught.value)


def test_batch_pools_go_to_the_batch_partition_and_sizing_keys_keep_the_digest() -> None:
    plain = _config({})
    elastic = _config({"max_replicas": 4, "backlog_per_replica": 10, "scale_down_after_s": 5})
    assert pool_spec_digest(plain, plain.pools[1]) == pool_spec_digest(elastic, elastic.pools[1])
    preemptible = _config({}, batch_partition="gpu-batch")
    assert build_job_spec(preemptible, preemptible.pools[1]).partition == "gpu-batch"
    assert build_job_spec(preemptible, preemptible.pools[0]).partition == "gpu"
    assert pool_spec_digest(preemptible, preemptible.pools[0]) == pool_spec_digest(
        plain, plain.pools[0]
    )
    assert pool_spec_digest(preemptible, preemptible.pools[1]) != pool_spec_digest(
        plain, plain.pools[1]
    )


def job(job_id: int, pool: str, *, pending: bool = False) -> ObservedJob:
    return ObservedJob(job_id=job_id, pool=pool, pending=pending, submit_time=job_id)


def test_a_poll_grows_into_idle_gpus_and_shrinks_after_the_backlog(tmp_path: Path) -> None:
    config = parse_config({
        "state_dir": str(tmp_path),
        "pools": [{"name": "chat", "model_path": "/m"},
                  {"name": "bulk", "model_path": "/m", "served_model_name": "chat",
                   "role": "batch", "replicas": 0, "max_replicas": 3, "backlog_per_replica": 2,
                   "scale_down_after_s": 30}],
    })  # fmt: skip
    registry = CollectorRegistry()
    pools = BatchPools(registry)
    desired = {"chat": 1, "bulk": 0}
    chat = [job(1, "chat")]
    nodes = [node("n1", 1), node("n2", 0)]

    def size(jobs: list[ObservedJob], now: float, draining: dict[int, float] | None = None) -> int:
        return pools.resize(config, desired, jobs, draining or {}, nodes, now)["bulk"]

    assert size(chat, 0) == 0
    store = BatchStore(Path(config.batch_dir()))
    _add_batch(store, ["chat"] * 5, status="in_progress")
    assert size(chat, 1) == 3
    assert (
        registry.get_sample_value("hpcserve_poolmgr_batch_backlog_requests", {"pool": "bulk"}) == 5
    )
    bulk = [job(2, "bulk"), job(3, "bulk"), job(4, "bulk")]
    # An interactive job waits: the batch pool does not grow past what runs.
    assert size([*chat, job(5, "chat", pending=True), bulk[0]], 2) == 1
    assert size([*chat, *bulk], 3) == 3
    (record,) = store.active_batches()
    store.update_batch(record.id, completed=5)
    store.close()
    assert size([*chat, *bulk], 10) == 3  # holds while the backlog may come back
    assert size([*chat, *bulk], 33) == 0  # 30 s after the last poll that saw a backlog


def test_an_adapters_backlog_counts_for_the_batch_pool_of_its_base_version(
    tmp_path: Path,
) -> None:
    from hpcserve.modelcache.manifest import build_manifest
    from hpcserve.modelcache.registry import Registry

    files = tmp_path / "files"
    files.mkdir()
    (files / "config.json").write_text("{}")
    manifest = build_manifest(files)
    with Registry(tmp_path / "reg.sqlite3") as reg:
        reg.add_version("llama", str(files), manifest)
        reg.add_adapter("docs-a", "llama@1", str(files), manifest, rank=8)
        reg.add_version("llama", str(files), manifest)
        reg.add_adapter("docs-b", "llama@2", str(files), manifest, rank=8)
    config = parse_config({
        "engine": {"cache_dir": str(tmp_path / "cache")},
        "pools": [{"name": "old", "model_ref": "llama@1", "role": "batch", "max_loras": 2,
                   "max_replicas": 2},
                  {"name": "new", "model_ref": "llama@2", "role": "batch", "max_loras": 2,
                   "max_replicas": 2, "served_model_name": "llama2"},
                  {"name": "nolora", "model_ref": "llama@2", "role": "batch",
                   "max_replicas": 2, "served_model_name": "llama3"}],
    })  # fmt: skip
    backlog = {"docs-a": 3, "docs-b": 5, "llama": 7}
    assert adapter_backlog(tmp_path / "reg.sqlite3", config.pools, backlog) == {
        "old": 3,
        "new": 5,
    }
    assert adapter_backlog(tmp_path / "missing.sqlite3", config.pools, backlog) == {}
