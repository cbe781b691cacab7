"""TTFT/TPOT p95 over a short and a long window from the engines' cumulative histograms
(poolmgr/slo_windows.py), and the autoscaler's use of them as an SLO-burn signal."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import AutoscaleConfig, parse_config
from hpcserve.contracts.protocol import LatencyHistogram, ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.autoscale import AutoscaleState, ReplicaSignal, Signals, decide
from hpcserve.poolmgr.autoscale_pools import AutoscaledPools
from hpcserve.poolmgr.reconcile import ObservedJob
from hpcserve.poolmgr.slo_windows import SloWindows, quantile

BOUNDS = [0.1, 0.5, 1.0, 2.0]


def hist(*counts: int, total: int | None = None) -> LatencyHistogram:
    """Cumulative counts per bound of BOUNDS."""
    return LatencyHistogram(BOUNDS, list(counts), counts[-1] if total is None else total)


@pytest.mark.parametrize(
    ("h", "p95"),
    [
        (hist(100, 100, 100, 100), 0.095),  # all under 0.1: interpolated within [0, 0.1]
        (hist(0, 0, 100, 100), 0.975),  # all in (0.5, 1.0]
        (hist(50, 90, 100, 100), 0.75),  # rank 95 halfway through (0.5, 1.0]
        (hist(0, 0, 0, 0, total=10), 2.0),  # beyond the last finite bound: that bound
        (hist(0, 0, 0, 0), None),  # nothing observed
    ],
)
def test_quantile_interpolates_within_the_bucket(h: LatencyHistogram, p95: float | None) -> None:
    got = quantile(0.95, h)
    assert got == pytest.approx(p95) if p95 is not None else got is None


def info(replica_id: str, ttft: LatencyHistogram | None, tpot: LatencyHistogram | None = None,
         pool: str = "chat") -> ReplicaInfo:  # fmt: skip
    return ReplicaInfo(replica_id=replica_id, model=pool, url="http://n:1", pool=pool,
                       slurm_job_id=int(replica_id[1:]), node="n", age_s=1, last_seen_age_s=0,
                       in_flight=0, load=ReplicaLoad(ttft=ttft, tpot=tpot))  # fmt: skip


def test_windows_are_deltas_summed_over_replicas_with_restarts_and_too_few_requests() -> None:
    slo = SloWindows()
    # t=0: r1 has served 1000 fast requests before; t=60..600 every new one is slow (1-2 s).
    slo.observe([info("r1", hist(1000, 1000, 1000, 1000))], 0, 600)
    slo.observe([info("r1", hist(1000, 1000, 1000, 1060))], 540, 600)
    slo.observe([info("r1", hist(1000, 1000, 1000, 1100)),
                 info("r2", hist(0, 0, 0, 0))], 600, 600)  # fmt: skip
    assert slo.p95(["r1"], "ttft", 60, 600, 20) == pytest.approx(1.95)  # 40 slow ones
    # The long window: 100 slow of 100 (the fast ones are older than the window's base).
    assert slo.p95(["r1"], "ttft", 600, 600, 20) == pytest.approx(1.95)
    assert slo.p95(["r1"], "ttft", 60, 600, 41) is None  # fewer than min_requests
    assert slo.p95(["r1"], "tpot", 60, 600, 1) is None  # not reported
    # r2 joins with fast requests; r1's engine restarted (its counts fell): its counts since.
    slo.observe([info("r1", hist(10, 10, 10, 10)), info("r2", hist(200, 200, 200, 200))], 660, 600)
    assert slo.p95(["r1", "r2"], "ttft", 60, 660, 20) == pytest.approx(0.095)
    # A replica gone from the list is forgotten.
    slo.observe([info("r2", hist(200, 200, 200, 200))], 720, 600)
    assert slo.p95(["r1"], "ttft", 60, 720, 1) is None


SLO = AutoscaleConfig(max=4, ttft_p95_s=0.8, scale_up_window_s=0, scale_up_cooldown_s=0,
                      scale_down_window_s=0, scale_down_cooldown_s=0, target_in_flight=8)  # fmt: skip
IDLE = [ReplicaSignal(1, 1, 0, 0.1)] * 2  # load that fits one replica fewer


@pytest.mark.parametrize(
    ("short", "long", "target", "reason"),
    [
        (1.3, 0.9, 3, "up 2->3: TTFT p95 1.3 s over 60 s and 0.9 s over 600 s > 0.8 s for 0 s"),
        (1.3, 0.7, 2, "steady at 2"),  # a short spike the long window does not confirm
        (1.3, None, 2, "steady at 2"),  # too few requests in the long window
        (0.5, 0.9, 1, "down 2->1: 2 in flight fits 1 replica(s) at <= 50% of 8 for 0 s"),
    ],
)
def test_slo_burn_over_both_windows_scales_up_and_a_short_one_blocks_scale_down(
    short: float, long: float | None, target: int, reason: str
) -> None:
    sig = Signals(IDLE, ttft_p95_short=short, ttft_p95_long=long)
    decision = decide(SLO, sig, AutoscaleState(target=2), 1000)
    assert (decision.target, decision.reason) == (target, reason)


def test_the_pool_manager_reads_the_engines_histograms_through_the_router() -> None:
    config = parse_config({"pools": [{"name": "chat", "model_path": "/m", "replicas": 1,
        "autoscale": {"max": 3, "scale_up_window_s": 0, "slo_short_window_s": 10,
                      "slo_long_window_s": 100}}]})  # fmt: skip
    registry = CollectorRegistry()
    pools = AutoscaledPools(registry)
    jobs = [ObservedJob(job_id=1, pool="chat", pending=False, submit_time=1, serving=True)]

    def step(now: float, ttft: LatencyHistogram) -> int:
        return pools.resize(config, {"chat": 1}, {}, jobs, {}, [info("r1", ttft)], {}, now)["chat"]

    # 100 fast requests every 10 s for 100 s, then 20 slow ones every 10 s.
    fast = slow = 0
    for t in range(0, 101, 10):
        assert step(t, hist(fast, fast, fast, fast)) == 1
        fast += 100
    fast -= 100
    targets = {}
    for t in range(110, 200, 10):
        slow += 20
        targets[t] = step(t, hist(fast, fast, fast, fast + slow))
        if targets[t] == 2:
            break
    # At 110 s the short window burns, the long one (900 fast, 20 slow) does not: hold.
    assert targets[110] == 1 and max(targets) > 110
    assert pools.decisions["chat"].reason.startswith("up 1->2: TTFT p95 1.95 s over 10 s and "), (
        pools.decisions["chat"].reason
    )
    assert "; TTFT p95 1.95 s" in pools.signals["chat"].summary()
