"""Which signals an autoscaled pool scales on, by its role, and a prefill or decode
replica's capacity from the planner's PD model (issue 22: each pool on its own signals).

A disaggregated model's two pools do different work, so each is sized by what it alone
decides (poolmgr/autoscale.py asks ``watches`` for every rule that reads a signal):

| role | waiting | KV usage | TTFT burn | TPOT burn | router's in flight |
| --- | --- | --- | --- | --- | --- |
| interactive | yes | yes | yes | yes | yes |
| prefill | yes (prompts waiting to be computed) | no | yes | no | yes |
| decode | yes | yes | no | yes | no |

Every role also scales on its load (the engines' running + waiting, or the router's
in-flight count where it counts) against one replica's capacity. Why: a prefill replica
answers one token per request, so its engines report no TPOT at all, and its KV cache holds
prompts only until they are handed over; a decode replica's TTFT is the transfer plus one
step, while the prompt's wait, the part more replicas shorten, is the prefill pool's; and
the router counts a decode replica in flight from the Route on, while the request still
waits for its prefill, so a prefill backlog would grow the wrong pool. The pool manager refuses at
start an SLO set on a pool whose role cannot see it (hpcserve/config.py
``_check_autoscale``).

Capacity (``autoscale.capacity`` on a prefill or decode pool), from hpcserve/planner/pd.py:
a prefill replica carries the largest rate whose TTFT p95 there (the M/G/1 wait for the
prompts ahead plus its own prompt) is within ``ttft_p95_s``; a decode replica the largest
batch whose step (no prompt shares it) is within ``tpot_p95_s``, capped by its KV cache
and max_num_seqs. Failure mode: the queueing approximations of planner/pd.py (optimistic
near saturation), and the transfer is not counted against the prefill's TTFT.
"""

from __future__ import annotations

import math

from hpcserve.planner import pd
from hpcserve.planner.setup import Setup

SIGNALS = ("waiting", "kv", "ttft", "tpot", "in_flight")
BY_ROLE: dict[str, frozenset[str]] = {
    "prefill": frozenset({"waiting", "ttft", "in_flight"}),
    "decode": frozenset({"waiting", "kv", "tpot"}),
}


def watches(role: str, signal: str) -> bool:
    """Whether a pool of `role` scales on `signal` (one of SIGNALS); every signal for a
    role without a row (interactive)."""
    assert signal in SIGNALS, signal
    return signal in BY_ROLE.get(role, SIGNALS)


def pd_capacity(role: str, setup: Setup, ttft_s: float, tpot_s: float) -> tuple[int, float, str]:
    """One prefill or decode replica's (in flight, requests/s, what bounds it) from the
    planner's PD model, for the setup's workload (prompt + output tokens)."""
    shape = setup.request.request_shape
    assert shape is not None  # autoscale.capacity gives both
    mix = [pd.Shape(shape[0], shape[1])]
    engine = pd.Engine(
        setup.factors.max_num_batched_tokens, setup.factors.max_num_seqs, setup.fit.kv_tokens
    )
    if role == "prefill":
        cap = pd.prefill_capacity(setup.model, engine, mix, ttft_s)
    else:
        cap = pd.decode_capacity(setup.model, engine, mix, tpot_s)
    why = f"PD {role} replica; bound by {cap.bound}"
    if not cap.met:
        slo = f"TTFT {ttft_s:g} s" if role == "prefill" else f"TPOT {tpot_s:g} s"
        why = f"PD {role} replica; misses {slo} even at the lightest load ({cap.bound})"
    # A prefill replica's in-flight count is short-lived: at least one, rounded up so a
    # replica is not judged full below what the model says it carries.
    return max(1, math.ceil(cap.in_flight - 1e-9)), cap.requests_per_s, why
