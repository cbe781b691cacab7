"""A prefill and a decode pool scale on their own signals (poolmgr/autoscale_roles.py, issue
22): the decision per role as tables on a fake clock, the capacity from the planner's PD
model, and the start-up check of SLOs a role cannot see."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import AutoscaleConfig, ConfigError, parse_config
from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.planner import Factors, PlanRequest, pd
from hpcserve.planner.plan import resolve
from hpcserve.poolmgr.autoscale import AutoscaleState, ReplicaSignal, Signals, decide
from hpcserve.poolmgr.autoscale_capacity import modelled
from hpcserve.poolmgr.autoscale_pools import AutoscaledPools
from hpcserve.poolmgr.autoscale_roles import watches
from hpcserve.poolmgr.reconcile import ObservedJob

CFG = AutoscaleConfig(
    min=1,
    max=6,
    target_in_flight=8,  # the load below (1 running per replica) never needs more replicas
    scale_up_window_s=10,
    scale_up_cooldown_s=30,
    scale_down_window_s=60,
    scale_down_cooldown_s=120,
)
BURN, OK = 2.0, 0.01  # a p95 far above either SLO (0.8 s, 0.05 s), one well within


def signals(role: str, **kw: Any) -> Signals:
    """Two serving replicas running one request each, nothing else unless given."""
    kv = kw.pop("kv", 0.1)
    waiting = kw.pop("waiting", 0)
    rows = [ReplicaSignal(1, 1, waiting, kv)] * 2
    return Signals(rows, role=role, **kw)


def run(sig: Signals, seconds: float) -> str:
    """The pool's first change while `sig` holds for `seconds` from target 2 ("hold": none)."""
    now = 1000.0
    decision = decide(CFG, sig, AutoscaleState(target=2), now)
    while seconds > 0 and not decision.changed:
        now, seconds = now + 1, seconds - 1
        decision = decide(CFG, sig, decision.state, now)
    return decision.reason if decision.changed else "hold"


TTFT_BURN = {"ttft_p95_short": BURN, "ttft_p95_long": BURN}
TPOT_BURN = {"tpot_p95_short": BURN, "tpot_p95_long": BURN}


@pytest.mark.parametrize(
    ("case", "sig", "interactive", "prefill", "decode"),
    [
        ("KV cache full", {"kv": 0.95}, "up", "hold", "up"),
        ("TTFT burnt", TTFT_BURN, "up", "up", "hold"),
        ("TPOT burnt", TPOT_BURN, "up", "hold", "up"),
        ("requests waiting", {"waiting": 5}, "up", "up", "up"),
        ("nothing", {}, "hold", "hold", "hold"),
    ],
)
def test_scale_up_on_the_roles_own_signals(case, sig, interactive, prefill, decode) -> None:
    for role, expected in (("interactive", interactive), ("prefill", prefill), ("decode", decode)):
        got = run(signals(role, **sig), CFG.scale_up_window_s)
        assert got.split(" ", 1)[0] == expected, (case, role, got)


@pytest.mark.parametrize(
    ("case", "sig", "interactive", "prefill", "decode"),
    [
        # One replica fewer would hold 2 x 60% of KV: too full for a pool that watches KV.
        ("KV spread over one fewer too full", {"kv": 0.6}, "hold", "down", "hold"),
        # The short window's p95 above its SLO keeps a pool that holds that SLO.
        ("TTFT short window over", {"ttft_p95_short": BURN}, "hold", "hold", "down"),
        ("TPOT short window over", {"tpot_p95_short": BURN}, "hold", "down", "hold"),
        ("idle enough", {"ttft_p95_short": OK, "tpot_p95_short": OK}, "down", "down", "down"),
    ],
)
def test_scale_down_holds_only_for_the_roles_own_signals(
    case, sig, interactive, prefill, decode
) -> None:
    for role, expected in (("interactive", interactive), ("prefill", prefill), ("decode", decode)):
        got = run(signals(role, **sig), CFG.scale_down_window_s + 1)
        assert got.split(" ", 1)[0] == expected, (case, role, got)


def test_the_reason_and_summary_name_only_the_roles_slo() -> None:
    both = {**TTFT_BURN, **TPOT_BURN}
    prefill = run(signals("prefill", **both), CFG.scale_up_window_s)
    decode = run(signals("decode", **both), CFG.scale_up_window_s)
    assert "TTFT p95" in prefill and "TPOT" not in prefill
    assert "TPOT p95" in decode and "TTFT" not in decode
    assert "TPOT" not in signals("prefill", **both).summary()
    assert "TTFT" not in signals("decode", **both).summary()
    assert "TTFT" in signals("interactive", **both).summary()
    assert watches("interactive", "kv") and not watches("prefill", "kv")


# --- capacity from the planner's PD model ------------------------------------------------

CAPACITY = {"model": "llama-3.1-8b", "gpu": "h100", "prompt_tokens": 3000, "output_tokens": 200}


def pools(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None):
    base = {"model_path": "/m", "engine": "sim", "served_model_name": "chat", "replicas": 1}
    auto = {"max": 4, "capacity": CAPACITY}
    return parse_config(
        {
            "pools": [
                {**base, "name": "chat-prefill", "role": "prefill",
                 "autoscale": {**auto, **(prefill or {})}},
                {**base, "name": "chat-decode", "role": "decode",
                 "autoscale": {**auto, **(decode or {})}},
            ]
        }
    ).pools  # fmt: skip


def _setup():
    request = PlanRequest(
        model="llama-3.1-8b",
        gpu="h100",
        context=3200,
        requests_per_s=1.0,
        prompt_tokens=3000,
        output_tokens=200,
        ttft_slo_ms=800,
        tpot_slo_ms=50,
    )
    return resolve(request, Factors())


def test_prefill_and_decode_capacity_come_from_the_planners_pd_model() -> None:
    prefill_pool, decode_pool = pools()
    prefill, decode = modelled(prefill_pool), modelled(decode_pool)
    setup = _setup()
    engine = pd.Engine(
        setup.factors.max_num_batched_tokens, setup.factors.max_num_seqs, setup.fit.kv_tokens
    )
    mix = [pd.Shape(3000, 200)]
    # Prefill: the rate at the TTFT SLO, below what the replica computes flat out.
    service = pd.prefill_service_s(setup.model, 3000, engine.token_budget)
    p = pd.prefill_capacity(setup.model, engine, mix, 0.8)
    assert p.met and 0 < p.requests_per_s < 1 / service
    assert prefill.requests_per_s == pytest.approx(p.requests_per_s)
    assert "PD prefill replica; bound by TTFT p95 0.8 s" in prefill.source
    # Decode: the largest batch whose step is within the TPOT SLO (else the KV cache).
    d = pd.decode_capacity(setup.model, engine, mix, 0.05)
    assert d.met and decode.in_flight == int(d.in_flight) > 1
    assert decode.requests_per_s == pytest.approx(d.requests_per_s)
    assert "PD decode replica" in decode.source
    if d.bound.startswith("TPOT"):
        step = setup.model.step_time
        ctx = 3000 + 100
        assert step(pd.decode_step(decode.in_flight, ctx)).total_s <= 0.05
        assert step(pd.decode_step(decode.in_flight + 1, ctx)).total_s > 0.05
    # The colocated answer for the same workload differs: it shares steps with prompts.
    colocated = modelled(msgspec.structs.replace(decode_pool, role="interactive"))
    assert colocated.source != decode.source


def test_a_prefill_slo_it_cannot_meet_is_said_so() -> None:
    prefill_pool, _ = pools(prefill={"ttft_p95_s": 0.001})
    capacity = modelled(prefill_pool)
    assert capacity.in_flight == 1 and "misses TTFT 0.001 s" in capacity.source


# --- validated at start ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefill", "decode", "error"),
    [
        ({"tpot_p95_s": 0.03}, {}, r"pools\[0\]\.autoscale\.tpot_p95_s: .*prefill pool.*no TPOT"),
        ({}, {"ttft_p95_s": 0.5}, r"pools\[1\]\.autoscale\.ttft_p95_s: .*decode pool"),
        ({"min": 0}, {}, r"pools\[0\]\.autoscale\.min: 0 on prefill pool"),
        ({}, {"min": 0}, r"pools\[1\]\.autoscale\.min: 0 on decode pool"),
    ],
)
def test_an_slo_the_role_cannot_see_is_refused_naming_the_key(prefill, decode, error) -> None:
    with pytest.raises(ConfigError, match=error):
        pools(prefill, decode)


def test_each_role_may_set_its_own_slo() -> None:
    prefill, decode = pools({"ttft_p95_s": 0.5}, {"tpot_p95_s": 0.03})
    assert prefill.autoscale is not None and prefill.autoscale.ttft_p95_s == 0.5
    assert decode.autoscale is not None and decode.autoscale.tpot_p95_s == 0.03


# --- in the pool manager ------------------------------------------------------------------


def test_the_pool_manager_sizes_each_pool_of_a_pair_on_its_own_signals() -> None:
    """A prefill backlog: prompts wait on the prefill replica, and the router counts the
    decode replica in flight for the same requests (from their Route on); only the prefill
    pool grows. The decode pool's SLO objective for alerts is its TPOT alone."""
    base = {"model_path": "/m", "engine": "sim", "served_model_name": "chat", "replicas": 1}
    auto = {"max": 4, "target_in_flight": 4, "scale_up_window_s": 0}
    config = parse_config(
        {
            "pools": [
                {**base, "name": "chat-prefill", "role": "prefill", "autoscale": auto},
                {**base, "name": "chat-decode", "role": "decode", "autoscale": auto},
            ]
        }
    )

    def replica(job_id: int, pool: str, role: str, in_flight: int, running: int, waiting: int):
        return ReplicaInfo(
            replica_id=f"r{job_id}", model="chat", url="http://n:1", pool=pool,
            slurm_job_id=job_id, node="n", age_s=1, last_seen_age_s=0, in_flight=in_flight,
            load=ReplicaLoad(running=running, waiting=waiting, kv_usage=0.1), role=role,
        )  # fmt: skip

    jobs = [
        ObservedJob(job_id=1, pool="chat-prefill", pending=False, submit_time=1, serving=True),
        ObservedJob(job_id=2, pool="chat-decode", pending=False, submit_time=1, serving=True),
    ]
    replicas = [
        replica(1, "chat-prefill", "prefill", in_flight=12, running=1, waiting=11),
        replica(2, "chat-decode", "decode", in_flight=13, running=1, waiting=0),
    ]
    registry = CollectorRegistry()
    pools = AutoscaledPools(registry)
    desired = {"chat-prefill": 1, "chat-decode": 1}
    got = pools.resize(config, desired, {}, jobs, {}, replicas, {}, 100.0)
    # 12 in flight at the 1 its engine runs need 12 prefill replicas: max 4. The decode
    # replica runs 1: its 13 in flight are mostly requests still waiting for their prefill.
    assert got == {"chat-prefill": 4, "chat-decode": 1}
    assert pools.decisions["chat-prefill"].reason.startswith("up 1->4: 11.0 waiting per replica")
    assert pools.decisions["chat-decode"].reason == "steady at 1"
    objective = "hpcserve_poolmgr_autoscale_slo_objective_seconds"
    assert registry.get_sample_value(objective, {"pool": "chat-decode", "slo": "tpot"}) == 0.05
    assert registry.get_sample_value(objective, {"pool": "chat-decode", "slo": "ttft"}) is None
    assert registry.get_sample_value(objective, {"pool": "chat-prefill", "slo": "ttft"}) == 0.8
    assert registry.get_sample_value(objective, {"pool": "chat-prefill", "slo": "tpot"}) is None
