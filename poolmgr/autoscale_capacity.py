"""What one replica of an autoscaled pool sustains, and where that number comes from.

With `autoscale.capacity` the capacity planner answers it (hpcserve/planner/): the pool's
workload (prompt + output tokens per request) on the roofline of its model and GPU, or on
the measured throughput of an `hpcserve plan --calibrate` file; the replica carries the
largest batch whose modelled TTFT and TPOT stay within the pool's SLO (autoscale.ttft_p95_s,
tpot_p95_s), capped by its KV cache and max_num_seqs, and finishes that batch's requests
per second. Without it, the config's `target_in_flight` (a guess, and said so).

Either way the engines' own figures win when lower: a replica that queues requests
(waiting > 0) runs all it can, so its running count is what one replica holds
(autoscale.py, `Signals.per_replica`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hpcserve.config import AutoscaleConfig, ConfigError, PlatformConfig, PoolConfig
from hpcserve.contracts.engine_args import PD_ROLES
from hpcserve.planner import Factors, PlanError, PlanRequest
from hpcserve.planner.capacity import best_point
from hpcserve.planner.plan import resolve
from hpcserve.poolmgr.autoscale_roles import pd_capacity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaCapacity:
    in_flight: int  # requests one replica carries within the SLO
    requests_per_s: float | None  # requests/s it finishes at that load; None: not modelled
    source: str  # where the numbers come from, for `hpcserve status` and the logs

    def describe(self) -> str:
        rate = f", {self.requests_per_s:.3g} req/s" if self.requests_per_s else ""
        return f"{self.in_flight} in flight{rate} ({self.source})"


def configured(auto: AutoscaleConfig) -> ReplicaCapacity:
    return ReplicaCapacity(auto.target_in_flight, None, "config target_in_flight, not modelled")


def modelled(pool: PoolConfig) -> ReplicaCapacity:
    """The planner's answer for the pool; PlanError when it cannot give one."""
    auto = pool.autoscale
    assert auto is not None and auto.capacity is not None
    cap = auto.capacity
    request = PlanRequest(
        model=cap.model,
        gpu=cap.gpu,
        weights_dtype=cap.weights_dtype,
        kv_dtype=cap.kv_dtype,
        context=cap.prompt_tokens + cap.output_tokens,
        tp=cap.tp or pool.tensor_parallel,
        requests_per_s=1.0,  # any rate: the workload's shape is what a replica's point needs
        prompt_tokens=cap.prompt_tokens,
        output_tokens=cap.output_tokens,
        ttft_slo_ms=auto.ttft_p95_s * 1e3,
        tpot_slo_ms=auto.tpot_p95_s * 1e3,
        calibrate=cap.calibrate or None,
    )
    setup = resolve(request, Factors(max_num_seqs=cap.max_num_seqs))
    basis = f"calibration {cap.calibrate}" if setup.calibrated else "roofline"
    what = (
        f"{basis}: {setup.replica.model.name} on {setup.replica.gpu.name} TP {setup.replica.tp}, "
        f"{cap.prompt_tokens}+{cap.output_tokens} tokens"
    )
    if pool.role in PD_ROLES:  # the planner's PD model (poolmgr/autoscale_roles.py)
        in_flight, rps, why = pd_capacity(pool.role, setup, auto.ttft_p95_s, auto.tpot_p95_s)
        return ReplicaCapacity(in_flight, rps, f"{what}; {why}")
    max_batch, bound = setup.max_batch()
    point, met = best_point(setup.point_at(), setup.limits(max_batch))
    if not met:
        why = f"misses TTFT {auto.ttft_p95_s:g} s / TPOT {auto.tpot_p95_s:g} s even at batch 1"
        return ReplicaCapacity(1, point.requests_per_s, f"{what}; {why}")
    limit = (
        f"{bound} ({max_batch})"
        if point.batch == max_batch
        else f"TTFT {point.ttft_s:.3g} s, TPOT {point.tpot_s * 1e3:.3g} ms"
    )
    return ReplicaCapacity(point.batch, point.requests_per_s, f"{what}; bound by {limit}")


def check(config: PlatformConfig) -> None:
    """At the pool manager's start: every pool's `autoscale.capacity` the planner can answer;
    ConfigError naming the key otherwise."""
    for i, pool in enumerate(config.pools):
        if pool.autoscale is not None and pool.autoscale.capacity is not None:
            try:
                modelled(pool)
            except PlanError as err:
                raise ConfigError(f"pools[{i}].autoscale.capacity: {err}") from None


class Capacities:
    """Each pool's capacity, worked out once per config of the pool (the planner is pure)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[PoolConfig, ReplicaCapacity]] = {}

    def of(self, pool: PoolConfig) -> ReplicaCapacity:
        auto = pool.autoscale
        assert auto is not None
        known = self._known.get(pool.name)
        if known is not None and known[0] == pool:
            return known[1]
        if auto.capacity is None:
            capacity = configured(auto)
        else:
            try:
                capacity = modelled(pool)
            except PlanError as err:  # a reload the start-up check did not see
                log.error("pool %s: autoscale.capacity: %s; using target_in_flight", pool.name, err)
                capacity = configured(auto)
        if known is None or known[1] != capacity:
            log.info("pool %s: one replica sustains %s", pool.name, capacity.describe())
        self._known[pool.name] = (pool, capacity)
        return capacity
