"""Batch pools: the PoolRoles filter, the router's pick, the batch bound's loads, the config."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hpcserve.config import ConfigError, RoutingConfig, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.gateway.batch.concurrency import BATCH_POOL_QUEUE, AdaptiveLimit
from hpcserve.gateway.batch.slots import ModelLoad, PoolSlots, model_loads
from hpcserve.poolmgr.spec import build_job_spec
from hpcserve.router.decide import Decider
from hpcserve.router.policies.base import RouteContext, RouteRequest
from hpcserve.router.policies.filters import BatchYields
from hpcserve.router.policies.pool_roles import PoolRoles
from hpcserve.router.registry import Registry


def fleet(roles: str, waiting: list[int] | None = None) -> Registry:
    """One replica per letter of `roles`: i interactive, b batch."""
    reg = Registry(lease_s=60)
    for i, role in enumerate(roles):
        reg.register(
            p.Register(f"r{i}", "m", f"u{i}", role="batch" if role == "b" else "interactive"),
            0.0,
        )
        reg.heartbeat(f"r{i}", p.ReplicaLoad(waiting=(waiting or [0] * len(roles))[i]), 0.0)
    return reg


def keep(reg: Registry, priority: str, *, lend_below: int = 0, allowed=None):
    ctx = RouteContext(RouteRequest("m", priority=priority), reg.table("m"), allowed=allowed)
    mask = PoolRoles(lend_below).keep(ctx)
    return None if mask is None else mask.tolist()


@pytest.mark.parametrize(
    ("roles", "priority", "expected"),
    [
        ("ii", "batch", None),  # no batch pool: routes as before
        ("ii", "interactive", None),
        ("ibb", "batch", [False, True, True]),
        ("ibb", "interactive", [True, False, False]),
        ("bb", "interactive", None),  # only a batch pool: interactive traffic uses it
        ("bb", "batch", [True, True]),
    ],
)
def test_pool_roles_split_batch_and_interactive_work(roles, priority, expected):
    assert keep(fleet(roles), priority) == expected


def test_interactive_work_uses_the_batch_pool_when_no_interactive_replica_is_usable():
    reg = fleet("ib")
    reg.set_routable("r0", False)
    assert keep(reg, "interactive") is None
    reg.set_routable("r0", True)
    assert keep(reg, "interactive") == [True, False]
    assert keep(reg, "interactive", allowed=np.array([False, True])) is None  # r0 excluded


def test_batch_work_leaves_an_unusable_batch_pool_to_batch_yields():
    reg = fleet("iib", waiting=[3, 0, 0])
    reg.set_routable("r2", False)
    ctx = RouteContext(RouteRequest("m", priority="batch"), reg.table("m"))
    assert PoolRoles().keep(ctx) is None
    assert BatchYields().keep(ctx).tolist() == [False, True, True]
    reg.set_routable("r2", True)
    # With a usable batch pool, queues there are batch work: BatchYields steps aside.
    reg.heartbeat("r2", p.ReplicaLoad(waiting=5), 0.0)
    assert BatchYields().keep(ctx) is None
    assert PoolRoles().keep(ctx).tolist() == [False, False, True]


def test_interactive_replicas_are_lent_only_with_clear_headroom():
    reg = fleet("iiib", waiting=[0, 1, 0, 9])
    for _ in range(3):
        reg.routed(reg.get("r2"))
    # r0: idle; r1: a request waiting; r2: 3 in flight (not below 3); r3: the batch pool.
    assert keep(reg, "batch", lend_below=3) == [True, False, False, True]
    assert keep(reg, "batch", lend_below=4) == [True, False, True, True]
    assert keep(reg, "batch") == [False, False, False, True]


def test_the_router_sends_batch_work_to_the_batch_pool_and_interactive_work_away():
    reg = fleet("ib")
    decider = Decider(RoutingConfig(), reg)
    # The idle interactive replica is cheaper, yet batch requests never go there...
    reg.heartbeat("r1", p.ReplicaLoad(running=200, waiting=50), 0.0)
    picks = {decider.pick(p.Route(i, "m", priority="batch"), 0.0).replica_id for i in range(20)}
    assert picks == {"r1"}
    # ...and interactive requests never go to the batch pool, however loaded r0 gets.
    reg.heartbeat("r0", p.ReplicaLoad(running=300, waiting=80), 0.0)
    picks = {decider.pick(p.Route(i, "m"), 0.0).replica_id for i in range(20)}
    assert picks == {"r0"}
    # A retry that excludes the only interactive replica goes to the batch pool.
    decision = decider.pick(p.Route(99, "m"), 0.0, [reg.get("r1")])
    assert decision is not None and decision.replica_id == "r1"


def test_a_session_shared_by_batch_and_interactive_requests_does_not_cross_roles():
    reg = fleet("ib")
    decider = Decider(RoutingConfig(), reg)
    first = decider.pick(p.Route(1, "m", priority="batch", session_key="s"), 0.0)
    assert first is not None and first.replica_id == "r1"
    # The session remembers the batch pool's replica; an interactive request of the same
    # session still goes to the interactive pool.
    later = decider.pick(p.Route(2, "m", session_key="s"), 0.0)
    assert later is not None and later.replica_id == "r0"


def test_the_role_survives_the_table_moving_rows():
    reg = fleet("bib")
    reg.deregister("r0", "gone")
    table = reg.table("m")
    assert table.batch_rows == 1
    assert {r.replica_id: bool(table.batch_pool[r.row]) for r in table.replicas} == {
        "r1": False,
        "r2": True,
    }


def info(replica_id: str, model: str, role: str, running: int, waiting: int) -> p.ReplicaInfo:
    return p.ReplicaInfo(
        replica_id, model, "u", "pool", 0, "n", 0.0, 0.0, 0,
        p.ReplicaLoad(running=running, waiting=waiting), role=role,
    )  # fmt: skip


def test_the_batch_bound_counts_only_the_batch_pool_when_a_model_has_one():
    models = [
        p.ModelInfo("m", 3),
        p.ModelInfo("plain", 2),
        p.ModelInfo("m-sql", 1, parent="m"),
        p.ModelInfo("alias", 1, alias_of="m@1"),
    ]
    replicas = [
        info("a", "m", "interactive", 5, 1),
        info("b", "m", "batch", 200, 10),
        info("c", "m", "batch", 100, 4),
        info("d", "plain", "interactive", 7, 2),
        info("e", "plain", "interactive", 1, 0),
    ]
    assert model_loads(models, replicas) == {
        "m": ModelLoad(2, waiting=14, running=300, batch_pool=True),
        "plain": ModelLoad(2, waiting=2, running=8),
        "m-sql": ModelLoad(2, waiting=14, running=300, batch_pool=True),
        "alias": ModelLoad(1),
    }


def test_a_batch_pool_turns_the_adaptive_bound_on():
    async def run() -> None:
        pool = PoolSlots(per_replica=4, adaptive=False)
        waiters = [
            asyncio.create_task(pool.for_model(model).acquire())
            for model in ("m", "plain")
            for _ in range(5)  # one more than the bound: held back
        ]
        await asyncio.sleep(0)
        pool.set_loads(
            {"m": ModelLoad(2, 0, 8, batch_pool=True), "plain": ModelLoad(2, 0, 8)}, adapt=True
        )
        assert pool.limits() == {"m": 8, "plain": 4}
        assert pool.for_model("m").capacity == 16
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(run())


def test_pool_role_is_validated_and_reaches_the_engine():
    base = {"name": "ex", "model_path": "/m", "engine": "sim"}
    with pytest.raises(ConfigError, match=r"pools\[0\]\.role"):
        parse_config({"pools": [{**base, "role": "offline"}]})
    with pytest.raises(ConfigError, match="batch_lend_below"):
        parse_config({"router": {"routing": {"batch_lend_below": -1}}})
    batch_pool = {**base, "name": "ex-batch", "served_model_name": "ex", "role": "batch"}
    with pytest.raises(ConfigError, match="served by two pools of role 'batch'"):
        parse_config({"pools": [batch_pool, {**batch_pool, "name": "ex-batch2"}]})
    config = parse_config({"pools": [batch_pool, base]})  # one model, one pool of each role
    batch, chat = (build_job_spec(config, pool) for pool in config.pools)
    assert ("HPCSERVE_POOL_ROLE", "batch") in batch.env
    assert all(key != "HPCSERVE_POOL_ROLE" for key, _ in chat.env)


def test_a_batch_pool_keeps_a_deeper_queue_on_its_engines():
    shared, batch_pool = (
        AdaptiveLimit(400, minimum=2, maximum=1024, adaptive=True) for _ in range(2)
    )
    batch_pool.batch_pool = True
    assert batch_pool.queue_share == BATCH_POOL_QUEUE
    for _ in range(2):  # 100 waiting beside 256 running, twice in a row
        shared.update(running=256, waiting=100, held_back=True)
        batch_pool.update(running=256, waiting=100, held_back=True)
    assert shared.per_replica == 320  # a quarter above what runs
    assert batch_pool.per_replica == 400  # within half of what runs: held
    # An overshoot that drains slowly (long outputs): the shared bound falls towards its
    # minimum, a batch pool's stops at what its engines run.
    for _ in range(30):
        shared.update(running=256, waiting=1500, held_back=False)
        batch_pool.update(running=256, waiting=1500, held_back=False)
    assert shared.per_replica == 2
    assert batch_pool.per_replica == 256
