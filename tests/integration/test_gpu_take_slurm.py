"""Taking GPUs when the partition is full (poolmgr/gpu_take.py), on the real two-node Slurm
cluster with simulated engines: pool "low" (priority 0) holds both nodes; pool "high"
(priority 10) must grow, its job waits for Resources, and the pool manager drains one of
low's replicas for it while clients keep using low through the real gateway and router
(every request answered). Waits are polls until the state is seen.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec
import openai
import pytest

from hpcserve.config import parse_config
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.state_files import read_status
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import JobState, SlurmJob
from tests.integration.pool_rig import PoolRig, poll_until
from tests.integration.slurm_helpers import wait_for

pytestmark = pytest.mark.slurm

KEY = "sk-gpu-take-test"
SIM = {"model_path": "/nonexistent", "engine": "sim", "gpus_per_replica": 4,  # a whole node
       "engine_args": ["--decode-ms-per-token", "5"]}  # fmt: skip
# Long windows: neither pool changes on its own load during the test.
SLOW = {"scale_down_window_s": 3600, "scale_up_window_s": 3600}


def jobs_of(slurm: SlurmCLI, name: str) -> list[SlurmJob]:
    return [j for j in slurm.jobs(name_prefix=name).jobs if j.name == name]


def test_a_waiting_pool_of_higher_priority_takes_a_replica_through_drain(rig: PoolRig) -> None:
    base = msgspec.to_builtins(rig.config("gt", SIM))
    base["poolmgr"]["take_gpus_after_s"] = 1
    base["pools"] = [
        {"name": "low", "replicas": 2, "priority": 0, **SIM,
         "autoscale": {"min": 1, "max": 2, **SLOW}},
        {"name": "high", "replicas": 0, "priority": 10, **SIM,
         "autoscale": {"min": 0, "max": 1, **SLOW}},
    ]  # fmt: skip
    config = parse_config(base)
    manager = PoolManager(config, rig.slurm)
    poll_until(manager.poll_once, "low serving on both nodes", lambda: len(rig.serving("low")) == 2)
    stop = threading.Event()
    ok, errors = [0], []

    def use_low(client: openai.OpenAI) -> None:
        while not stop.is_set():
            try:
                client.completions.create(model="low", prompt="x", max_tokens=20)
                ok[0] += 1
            except Exception as err:  # every failure is recorded, and asserted on
                errors.append(repr(err))

    with (
        rig.openai_client(config, KEY, {"low", "high"}) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        try:
            for _ in range(4):
                pool.submit(use_low, client)
            wait_for("low in use", lambda: ok[0] >= 10)
            # The admin's schedule would do the same: high must grow (its floor is now 1).
            floor = {**base["pools"][1]["autoscale"], "min": 1}
            base["pools"][1] = {**base["pools"][1], "replicas": 1, "autoscale": floor}
            manager.config = parse_config(base)
            poll_until(manager.poll_once, "high's job pending for Resources", lambda: [
                j for j in jobs_of(rig.slurm, "gt-high")
                if j.state is JobState.PENDING and j.state_reason == "Resources"])  # fmt: skip
            poll_until(manager.poll_once, "high serving", lambda: len(rig.serving("high")) == 1)
            served = ok[0]
            wait_for("low still answering", lambda: ok[0] >= served + 10)
        finally:
            stop.set()
    assert errors == []
    history = rig.history()
    low = jobs_of(rig.slurm, "gt-low")
    ended = [j for j in low if not j.state.is_active]
    assert [j.state for j in ended] == [JobState.COMPLETED], history  # drained, not killed
    assert len([j for j in low if j.state is JobState.RUNNING]) == 1
    status = read_status(rig.state_dir)
    assert status is not None
    (low_status,) = [p for p in status.pools if p.pool == "low"]
    assert low_status.autoscale is not None
    assert low_status.autoscale.last_reason.startswith(
        "taken 2->1: taken for pool high (priority 10 > 0): its job "
    ), low_status.autoscale.last_reason
    assert low_status.desired == 1
