"""The plan's PD section: disaggregated prefill/decode vs colocated on the same GPUs."""

from __future__ import annotations

from hpcserve.planner import pd
from hpcserve.planner.errors import PlanError
from hpcserve.planner.replica import kv_bytes_per_token
from hpcserve.planner.report import FleetReport, PDReport
from hpcserve.planner.setup import Setup

BASIS = (
    "estimate: the step model's prefill and decode times with queueing approximations "
    "(M/G/c prompt queues, Poisson arrivals); goodput = the largest rate meeting both p95s"
)


def mix_of(setup: Setup) -> list[pd.Shape]:
    req = setup.request
    if req.pd_mix is not None:
        return pd.parse_mix(req.pd_mix)
    shape = req.request_shape
    assert shape is not None  # PlanRequest checks that --pd has a mix
    return [pd.Shape(shape[0], shape[1])]


def pd_report(setup: Setup, fleet: FleetReport | None) -> PDReport | None:
    req, replica, factors = setup.request, setup.replica, setup.factors
    if not req.pd:
        return None
    assert req.ttft_slo_ms is not None and req.tpot_slo_ms is not None
    gpus = req.gpus or (fleet.size.gpus if fleet else replica.gpu.gpus_per_node)
    replicas = gpus // replica.tp
    if replicas < 2:
        raise PlanError(
            f"--pd: {gpus} GPUs hold {replicas} replica(s) of TP={replica.tp}; a PD split needs "
            "at least 2 (give --gpus)"
        )
    mix = mix_of(setup)
    longest = max(s.prompt + s.output for s in mix)
    if longest > req.context:
        raise PlanError(
            f"--pd-mix: a request of {longest:,} tokens exceeds --context {req.context}"
        )
    link = pd.get_link(req.pd_link, gb_s=req.pd_link_gb_s, latency_us=req.pd_link_latency_us)
    kv_bytes = kv_bytes_per_token(replica.model, replica.kv_dtype)
    engine = pd.Engine(factors.max_num_batched_tokens, factors.max_num_seqs, setup.fit.kv_tokens)
    comparison = pd.compare(
        setup.model,
        engine,
        mix,
        replicas=replicas,
        link=link,
        kv_bytes_per_token=kv_bytes,
        ttft_s=req.ttft_slo_ms / 1e3,
        tpot_s=req.tpot_slo_ms / 1e3,
        per_token=req.pd_per_token,
    )
    return PDReport(
        gpus=replicas * replica.tp,
        replicas=replicas,
        mix=pd.normalise(mix),
        link=link,
        kv_bytes_per_token=kv_bytes,
        comparison=comparison,
        ratio=f"{comparison.prefill}:{comparison.decode}",
        verdict=verdict(comparison),
        demand_rps=req.requests_per_s,
        basis=BASIS,
        wrong_if=[
            "near saturation and with heavy-tailed prompt lengths the queueing "
            "approximations are optimistic",
            "the KV transfer is modelled on an uncontended link; many prefill replicas behind "
            "one NIC share it",
            "the router is assumed to balance load evenly (no prefix-cache affinity)",
        ],
    )


def verdict(c: pd.PDComparison) -> str:
    ratio = f"{c.prefill}:{c.decode}"
    if c.colocated_rps <= 0 and c.pd_rps <= 0:
        return "neither layout meets the SLO at any rate"
    if c.pays:
        return f"PD pays: {ratio} serves {c.gain:+.0%} goodput over colocated replicas"
    if c.gain >= 0:
        return (
            f"PD does not pay: {ratio} gains {c.gain:+.0%}, within the model's error "
            f"(< {pd.PAYS_MARGIN:.0%}); keep colocated replicas"
        )
    return (
        f"PD does not pay: the best split ({ratio}) serves {-c.gain:.0%} less goodput than "
        "colocated replicas"
    )
