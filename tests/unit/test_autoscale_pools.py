"""The pool manager's autoscaled pools (poolmgr/autoscale_pools.py): the router's replica
list in, targets out, one log line and metric per change, and what `hpcserve status` shows."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from hpcserve.cli import main
from hpcserve.config import dump_config, parse_config
from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.autoscale_pools import AutoscaledPools
from hpcserve.poolmgr.reconcile import ObservedJob
from hpcserve.poolmgr.state_files import AutoscaleStatus, PoolStatus, read_overrides
from hpcserve.status import format_status, pool_row

CONFIG = parse_config(
    {
        "pools": [
            {"name": "chat", "model_path": "/m", "replicas": 1,
             "autoscale": {"max": 4, "target_in_flight": 4, "scale_up_window_s": 0,
                           "scale_down_window_s": 5, "scale_down_cooldown_s": 5}},
            {"name": "fixed", "model_path": "/m", "served_model_name": "f", "replicas": 2},
        ]
    }
)  # fmt: skip


def replica(job_id: int, *, running: int = 0, waiting: int = 0, pool: str = "chat") -> ReplicaInfo:
    return ReplicaInfo(
        replica_id=f"r{job_id}", model=pool, url="http://n:1", pool=pool, slurm_job_id=job_id,
        node="n", age_s=1, last_seen_age_s=0, in_flight=running + waiting,
        load=ReplicaLoad(running=running, waiting=waiting, kv_usage=0.1),
    )  # fmt: skip


def job(job_id: int, *, serving: bool = True, pool: str = "chat") -> ObservedJob:
    return ObservedJob(job_id=job_id, pool=pool, pending=False, submit_time=1, serving=serving)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_load_scales_up_then_idle_down_one_log_line_and_metric_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    pools = AutoscaledPools(registry)
    desired = {"chat": 1, "fixed": 2}
    caplog.set_level(logging.INFO, "hpcserve.poolmgr.autoscale_pools")

    def step(jobs: list[ObservedJob], replicas: list[ReplicaInfo], now: float,
             overrides: dict[str, int] | None = None) -> dict[str, int]:  # fmt: skip
        return pools.resize(CONFIG, desired, overrides or {}, jobs, {}, replicas, {}, now)

    # 10 in flight on one replica running 2 (8 waiting): 5 replicas at 2 each, max 4.
    assert step([job(1)], [replica(1, running=2, waiting=8)], 100) == {"chat": 4, "fixed": 2}
    assert step([job(1), *(job(i, serving=False) for i in (2, 3, 4))],
                [replica(1, running=2, waiting=8)], 101)["chat"] == 4  # fmt: skip
    four = [job(i) for i in (1, 2, 3, 4)]
    idle = [replica(i) for i in (1, 2, 3, 4)]
    targets = [step(four, idle, t)["chat"] for t in range(102, 112)]
    assert targets == [4] * 5 + [3] * 5  # the 5 s window, then one step; then the cooldown
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("pool chat: autoscale up 1->4: 8.0 waiting per replica > 2; ")
    assert "(1 serving, 0 starting; 10 in flight, 8 waiting, KV 10%)" in lines[0]
    assert lines[1].startswith("pool chat: autoscale down 4->3: 0 in flight fits 3 replica(s)")
    assert value(registry, "hpcserve_poolmgr_autoscale_target", pool="chat") == 3
    assert value(registry, "hpcserve_poolmgr_autoscale_target", pool="fixed") is None
    for direction, count in (("up", 1), ("down", 1)):
        assert value(registry, "hpcserve_poolmgr_autoscale_decisions_total",
                     pool="chat", direction=direction) == count  # fmt: skip
    # An admin's override wins (and is counted once); the other pool keeps its desired size.
    assert step(four, idle, 120, {"chat": 2}) == {"chat": 2, "fixed": 2}
    assert step(four, idle, 121, {"chat": 2})["chat"] == 2
    assert value(registry, "hpcserve_poolmgr_autoscale_decisions_total",
                 pool="chat", direction="override") == 1  # fmt: skip


def test_a_restart_keeps_the_replicas_it_finds_and_draining_ones_do_not_count() -> None:
    pools = AutoscaledPools(CollectorRegistry())
    jobs = [job(i) for i in (1, 2, 3)]
    got = pools.resize(CONFIG, {"chat": 1}, {}, jobs, {3: 50.0}, [replica(1), replica(2)], {}, 100)
    assert got["chat"] == 2 and pools.decisions["chat"].direction == "hold"
    assert (
        pools.signals["chat"].summary() == "2 serving, 0 starting; 0 in flight, 0 waiting, KV 10%"
    )


def test_without_an_answer_from_the_router_every_pool_holds() -> None:
    pools = AutoscaledPools(CollectorRegistry())
    busy = [replica(1, running=2, waiting=8)]
    assert pools.resize(CONFIG, {"chat": 1}, {}, [job(1)], {}, None, {}, 100)["chat"] == 1
    assert pools.decisions["chat"].reason == "the router did not answer: no load measured"
    assert pools.resize(CONFIG, {"chat": 1}, {}, [job(1)], {}, busy, {}, 101)["chat"] == 4


def test_status_shows_target_signals_and_the_last_reason() -> None:
    chat, fixed = CONFIG.pools
    auto = AutoscaleStatus(target=4, min=1, max=4, signals="1 serving, 3 starting; 10 in flight",
                           last_reason="up 1->4: 8.0 waiting per replica > 2", now="steady at 4")  # fmt: skip
    report = PoolStatus(pool="chat", model="chat", desired=4, live=4, serving=1, admin=0,
                        draining=0, retiring=0, autoscale=auto)  # fmt: skip
    rows = [pool_row(chat, [], [], report), pool_row(fixed, [], [], None)]
    assert rows[0]["autoscale"] == "1..4, target 4" and "autoscale" not in rows[1]
    text = format_status({"pools": rows, "jobs": [], "replicas": [], "nodes": [], "errors": []})
    header, first, _, detail, last, now = text.splitlines()
    assert "AUTOSCALE" in header and "1..4, target 4" in first
    assert detail.strip() == "chat: 1 serving, 3 starting; 10 in flight"
    assert last.strip() == "last change: up 1->4: 8.0 waiting per replica > 2"
    assert now.strip() == "now: steady at 4"


def test_hpcserve_scale_on_an_autoscaled_pool_pauses_it_until_reset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "hpcserve.toml"
    path.write_text(dump_config(msgspec.structs.replace(CONFIG, state_dir=str(tmp_path))))
    assert main(["scale", "chat", "3", "--config", str(path)]) == 0
    assert "desired replicas 3; autoscaling paused until --reset" in capsys.readouterr().out
    assert read_overrides(tmp_path) == {"chat": 3}
    assert main(["scale", "chat", "--reset", "--config", str(path)]) == 0
    assert "pool chat: autoscaling resumes" in capsys.readouterr().out
    assert read_overrides(tmp_path) == {}


ZERO = parse_config(
    {
        "pools": [
            {"name": "rare", "model_path": "/m", "served_model_name": "rare-model", "replicas": 1,
             "autoscale": {"min": 0, "max": 2, "idle_s": 30, "scale_down_cooldown_s": 0}},
        ]
    }
)  # fmt: skip


def test_scale_to_zero_counts_requests_between_polls_and_wakes_on_unserved_demand() -> None:
    pools = AutoscaledPools(CollectorRegistry())

    def step(now: float, routed: int | None, unserved: dict[str, float] | None = None) -> int:
        listed = [] if routed is None else [msgspec.structs.replace(replica(1, pool="rare"),
                                                                    routed=routed)]  # fmt: skip
        jobs = [] if routed is None else [job(1, pool="rare")]
        return pools.resize(ZERO, {"rare": 1}, {}, jobs, {}, listed, {}, now, unserved=unserved)[
            "rare"
        ]

    # Short requests that no poll sees in flight keep it awake: its routed count moves.
    assert [step(t, routed=t // 20) for t in range(100, 200, 5)] == [1] * 20
    assert pools.active_at["rare"] == 180
    # Nothing routed for 30 s (idle_s): it scales to zero, and stays there.
    assert step(209, routed=9) == 1
    assert step(210, routed=9) == 0
    assert pools.decisions["rare"].reason == "down 1->0: no request for 30 s (scale to zero)"
    assert step(300, routed=None) == 0
    # Demand for another model, or from before it went to zero, does not wake it.
    assert step(301, routed=None, unserved={"other": 0.1, "rare-model": 95}) == 0
    # A request that found no replica (the gateway holds it): woken at once.
    assert step(302, routed=None, unserved={"rare-model": 0.5}) == 1
    assert pools.decisions["rare"].reason.startswith("up 0->1: a request found no replica")
    # While it starts, the held request's repeated Routes keep it from idling back to zero.
    assert all(step(t, routed=None, unserved={"rare-model": 1}) == 1 for t in range(303, 400, 5))


def test_a_schedule_is_raised_ahead_by_the_measured_cold_start() -> None:
    from datetime import datetime

    scheduled = parse_config(
        {
            "pools": [
                {"name": "chat", "model_path": "/m", "replicas": 1,
                 "autoscale": {"max": 4, "schedule": [{"start": "09:00", "end": "18:00",
                                                       "min": 3}]}},
            ]
        }
    )  # fmt: skip
    pools = AutoscaledPools(CollectorRegistry())
    before = datetime.fromisoformat("2026-12-02 08:55").timestamp()  # host's local time
    args = ({"chat": 1}, {}, [job(1)], {}, [replica(1)], {})
    assert pools.resize(scheduled, *args, before, lead_s={"chat": 200})["chat"] == 1
    assert pools.resize(scheduled, *args, before + 1, lead_s={"chat": 400})["chat"] == 3
    assert pools.decisions["chat"].reason == (
        "up 1->3: schedule floor 3 (daily 09:00-18:00), raised 299 s ahead: cold start"
    )
    assert pools.signals["chat"].summary().endswith("; schedule floor 3")


def test_arrivals_are_the_routed_counts_between_polls_and_feed_the_forecast(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    pools = AutoscaledPools(registry, tmp_path)

    def step(now: float, routed: int) -> None:
        listed = [msgspec.structs.replace(replica(1), routed=routed)]
        pools.resize(CONFIG, {"chat": 1}, {}, [job(1)], {}, listed, {}, now, lead_s={"chat": 300})

    step(1000, 5000)  # the first poll: a count from before, not arrivals
    for i in range(1, 25):  # 10 requests every 5 s: 2 req/s
        step(1000 + 5 * i, 5000 + 10 * i)
    assert pools.forecasts.rate("chat") == pytest.approx(2.0)
    assert pools.signals["chat"].forecast_horizon_s == 300
    assert value(registry, "hpcserve_poolmgr_autoscale_rate_rps", pool="chat", kind="now") == (
        pytest.approx(2.0)
    )


def test_each_pools_slo_is_exported_beside_its_p95_for_the_alerts() -> None:
    registry = CollectorRegistry()
    AutoscaledPools(registry).resize(CONFIG, {"chat": 1, "fixed": 2}, {}, [job(1)], {},
                                     [replica(1)], {}, 1000.0)  # fmt: skip
    objective = "hpcserve_poolmgr_autoscale_slo_objective_seconds"
    assert value(registry, objective, pool="chat", slo="ttft") == 0.8
    assert value(registry, objective, pool="chat", slo="tpot") == 0.05
    assert value(registry, objective, pool="fixed", slo="ttft") is None  # not autoscaled
