"""Disaggregated prefill and decode (PD): when separate pools beat colocated replicas.

The same GPUs serve a workload two ways: ``n`` colocated replicas (each prefills and
decodes, vLLM's chunked prefill), or ``p`` prefill-only replicas that hand the prompt's KV
cache over a link to ``d = n - p`` decode-only replicas. Both are priced with the replica's
step model (the roofline, or --calibrate's measurements); for each the planner finds the
goodput, the largest request rate at which TTFT p95 and TPOT p95 stay within the SLO, and
proposes the ``p:d`` split with the highest one.

Per replica at a request rate ``r`` (a mix of classes i with prompt P_i, output O_i and
share s_i; O-bar the mean output):

- Decode step time: ``T_d(B)`` of B sequences at the output-weighted mean context, with
  ``B = r x O-bar x T`` in flight (Little's law).
- Colocated: each prompt adds ``D_i = step(B decodes + P_i prompt) - T_d(B)`` to one
  step, so the mean step is ``T = T_d / (1 - r x E[D])`` (solved for T by bisection).
  A request's TPOT is ``T_d`` plus the prompts that arrive while it decodes, spread over
  its O_i - 1 intervals: a compound Poisson sum, taken at its normal tail. TTFT is the
  M/G/1 wait for the prompts ahead (service D, load ``r x E[D]``) plus one step in
  progress plus its own step.
- PD prefill pool: one M/G/c queue (c = p: the router sends a prompt to the replica with
  the least backlog) with service ``S_i = step(P_i prompt)``; TTFT adds the KV transfer
  ``X_i = latency + P_i x KV bytes per token / link bandwidth`` and 1.5 decode steps (the
  step in progress, then the first token).
- PD decode replica: ``T_d(B)`` alone: no prompt ever shares its steps.
- M/G/c wait: mean ``W = P_wait E[S] / (c (1 - rho)) x (1 + Cs^2) / 2`` (Allen-Cunneen,
  P_wait by Erlang C; Pollaczek-Khinchine at c = 1), tail ``P_wait exp(-P_wait t / W)``
  (exact for exponential service).
- Capacity: B at most max_num_seqs and the KV cache's tokens over the mean context.

Failure mode: queueing approximations, not a simulation. They are fair at moderate load
and optimistic near saturation and for heavy-tailed mixes; the transfer is modelled on an
uncontended link, and prefill batching gains are not counted. bench/pd_goodput.py checks
the goodputs against the simulated fleet (sim/pd.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from hpcserve.planner.errors import PlanError
from hpcserve.planner.perfmodel import StepBatch, StepModel, decode_step, prefill_chunk

P95 = 0.95
Z95 = 1.6449  # standard normal 95th percentile
PAYS_MARGIN = 0.10  # PD "pays" when its goodput beats colocated by more than this share
_UNSTABLE = 1e9


class Link(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The path a prompt's KV cache takes from a prefill to a decode replica."""

    name: str
    gb_s: float  # achievable one-way bandwidth of one transfer, 1e9 bytes/s
    latency_s: float  # fixed cost per transfer: handshake, descriptor exchange, first byte

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gb_s * 1e9)


# Achievable figures: ~80% of the line rate for RDMA (NIXL/UCX), ~70% for TCP.
LINKS: dict[str, Link] = {
    # NVLink4 within a node: 450 GB/s one way per GPU.
    "nvlink": Link("NVLink (same node)", 360.0, 20e-6),
    # InfiniBand NDR, one 400 Gb/s HCA per GPU (50 GB/s).
    "ib": Link("InfiniBand NDR 400 Gb/s", 40.0, 100e-6),
    # RoCE v2 at 200 Gb/s (25 GB/s).
    "roce": Link("RoCE 200 Gb/s", 20.0, 200e-6),
    # 100 Gb/s Ethernet with TCP (12.5 GB/s).
    "ethernet": Link("Ethernet 100 Gb/s (TCP)", 8.75, 500e-6),
}


def get_link(name: str, *, gb_s: float | None = None, latency_us: float | None = None) -> Link:
    """A preset by name, with its bandwidth or latency overridden when given."""
    link = LINKS.get(name.strip().lower())
    if link is None:
        raise PlanError(f"--pd-link: unknown link {name!r}; known: {', '.join(LINKS)}")
    if gb_s is not None:
        link = msgspec.structs.replace(link, gb_s=gb_s)
    if latency_us is not None:
        link = msgspec.structs.replace(link, latency_s=latency_us / 1e6)
    return link


class Shape(msgspec.Struct, frozen=True):
    """One class of requests of a mix: prompt and output tokens, and its share of requests."""

    prompt: int
    output: int
    share: float = 1.0


def parse_mix(text: str) -> list[Shape]:
    """``PROMPT:OUTPUT:SHARE,...`` (shares are normalised); PlanError naming --pd-mix."""
    shapes = []
    for part in text.split(","):
        fields = part.strip().split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError
            prompt, output = int(fields[0]), int(fields[1])
            share = float(fields[2]) if len(fields) == 3 else 1.0
        except ValueError:
            raise PlanError(
                f"--pd-mix: {part.strip()!r} is not PROMPT:OUTPUT[:SHARE] "
                "(e.g. 3000:250:0.5,400:250:0.5)"
            ) from None
        if prompt < 1 or output < 2 or not share > 0:
            raise PlanError(
                f"--pd-mix: {part.strip()!r}: prompt must be >= 1, output >= 2 and share > 0"
            )
        shapes.append(Shape(prompt, output, share))
    return normalise(shapes)


def normalise(shapes: list[Shape]) -> list[Shape]:
    total = sum(s.share for s in shapes)
    return [msgspec.structs.replace(s, share=s.share / total) for s in shapes]


class Serving(msgspec.Struct, frozen=True):
    """What a pool or replica layout does at one request rate (whole fleet)."""

    rate: float  # requests/s into the whole fleet
    ttft_p95_s: float
    tpot_p95_s: float
    stable: bool  # False: a queue grows without bound, or KV / max_num_seqs overflows
    decode_batch: float  # sequences in flight per (decode) replica
    itl_p95_s: float = 0.0  # every token gap, not a request's mean (the stricter reading)

    def meets(self, ttft_s: float, tpot_s: float, *, per_token: bool = False) -> bool:
        tpot = self.itl_p95_s if per_token else self.tpot_p95_s
        return self.stable and self.ttft_p95_s <= ttft_s and tpot <= tpot_s


class Engine(msgspec.Struct, frozen=True):
    """A replica's limits: the step token budget, max sequences, KV tokens."""

    token_budget: int
    max_seqs: int
    kv_tokens: int


class _Mix:
    """Averages of a normalised mix that every formula uses."""

    def __init__(self, shapes: list[Shape]) -> None:
        if not shapes:
            raise PlanError("--pd-mix: no request classes")
        self.shapes = normalise(shapes)
        self.output = sum(s.share * s.output for s in self.shapes)
        # A request decodes for O steps, so the decoding population is weighted by O.
        weighted = sum(s.share * s.output * (s.prompt + s.output / 2) for s in self.shapes)
        self.decode_context = weighted / self.output
        self.longest = max(s.prompt + s.output for s in self.shapes)


def _decode_batch(
    model: StepModel, mix: _Mix, rate: float, step_of: Callable[[float], float]
) -> tuple[float, float] | None:
    """Solve ``T = step_of(B)`` with ``B = rate x O-bar x T``; (T, B) or None if unstable."""

    def excess(t: float) -> float:
        return step_of(rate * mix.output * t) - t

    low = step_of(0.0)
    if rate <= 0:
        return low, 0.0
    high = max(low, 1e-3)
    while excess(high) > 0:
        high *= 2
        if high > 100:
            return None
    for _ in range(60):
        mid = (low + high) / 2
        if excess(mid) > 0:
            low = mid
        else:
            high = mid
    return high, rate * mix.output * high


def _fits(engine: Engine, mix: _Mix, batch: float) -> bool:
    return batch <= engine.max_seqs and batch * mix.decode_context <= engine.kv_tokens


def _normal_tail(x: float) -> float:
    return 0.5 * math.erfc(x / math.sqrt(2))


def _quantile(tail: Callable[[float], float], p: float, high: float) -> float:
    """Smallest x with tail(x) <= 1 - p, by bisection in [0, high]."""
    target = 1 - p
    low = 0.0
    while tail(high) > target:
        high *= 2
        if high > 1e6:
            return math.inf
    for _ in range(60):
        mid = (low + high) / 2
        if tail(mid) > target:
            low = mid
        else:
            high = mid
    return high


def _erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c with ``offered`` = rate x mean service."""
    rho = offered / servers
    term, total = 1.0, 1.0  # offered^k / k!, summed for k < servers
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1 - rho)  # offered^c / c! / (1 - rho)
    return last / (total + last)


def _wait_tail(
    rate: float, services: list[tuple[float, float]], servers: int = 1
) -> Callable[[float], float]:
    """P(wait > t) of an M/G/c queue; ``services`` (share, seconds).

    Mean wait by Allen-Cunneen, ``W = P_wait x E[S] / (c (1 - rho)) x (1 + Cs^2) / 2``
    (Pollaczek-Khinchine at c = 1); tail ``P_wait exp(-P_wait t / W)``.
    """
    mean = sum(s * x for s, x in services)
    second = sum(s * x * x for s, x in services)
    rho = rate * mean / servers
    if rho <= 0:
        return lambda t: 0.0
    if rho >= 1:
        return lambda t: 1.0
    waits = _erlang_c(servers, rate * mean)
    scv = second / (mean * mean) - 1  # squared coefficient of variation of the service
    w_mean = waits * mean / (servers * (1 - rho)) * (1 + scv) / 2
    return lambda t: 1.0 if t < 0 else waits * math.exp(-waits * t / w_mean)


def colocated(model: StepModel, engine: Engine, mix_shapes: list[Shape], rate: float) -> Serving:
    """``rate`` requests/s into ONE colocated replica (prefill and decode share steps)."""
    mix = _Mix(mix_shapes)
    ctx = mix.decode_context

    def t_dec(batch: float) -> float:
        return model.step_time(decode_step(max(batch, 1.0), ctx)).total_s

    def deltas(batch: float) -> list[float]:
        base = t_dec(batch)
        out = []
        for s in mix.shapes:
            step = decode_step(max(batch, 1.0), ctx) + _prompt(s.prompt, engine.token_budget)
            out.append(model.step_time(step).total_s - base + _extra_chunks(model, s, engine))
        return out

    def mean_step(batch: float) -> float:
        load = rate * sum(s.share * d for s, d in zip(mix.shapes, deltas(batch), strict=True))
        return t_dec(batch) / (1 - load) if load < 1 else _UNSTABLE

    solved = _decode_batch(model, mix, rate, mean_step)
    if solved is None:
        return Serving(rate, math.inf, math.inf, False, math.inf, math.inf)
    step, batch = solved
    base, d = t_dec(batch), deltas(batch)
    e_d = sum(s.share * x for s, x in zip(mix.shapes, d, strict=True))
    e_d2 = sum(s.share * x * x for s, x in zip(mix.shapes, d, strict=True))

    def tpot_tail(x: float) -> float:
        total = 0.0
        for s in mix.shapes:
            n = rate * (s.output - 1) * step  # prompts arriving while it decodes
            mean, sd = n * e_d / (s.output - 1), math.sqrt(n * e_d2) / (s.output - 1)
            gap = x - base - mean
            total += s.share * (_normal_tail(gap / sd) if sd > 0 else float(gap < 0))
        return total

    wait = _wait_tail(rate, list(zip([s.share for s in mix.shapes], d, strict=True)))

    def ttft_tail(x: float) -> float:
        return sum(
            s.share * wait(x - base - dx - base) for s, dx in zip(mix.shapes, d, strict=True)
        )

    def itl_tail(x: float) -> float:
        # A step holds a prompt of class i with probability 1 - exp(-rate s_i T); every
        # decoding sequence's token gap is that step's time.
        slow = [1 - math.exp(-rate * s.share * step) for s in mix.shapes]
        tail = sum(q for q, dx in zip(slow, d, strict=True) if base + dx > x)
        return tail + (1.0 if base > x else 0.0)

    stable = _fits(engine, mix, batch) and rate * e_d < 1
    return Serving(
        rate,
        _quantile(ttft_tail, P95, step),
        _quantile(tpot_tail, P95, step),
        stable,
        batch,
        _quantile(itl_tail, P95, step),
    )


def _prompt(prompt: int, budget: int) -> StepBatch:
    """The first chunk of a prompt (the whole prompt when it fits the step's budget)."""
    return prefill_chunk(min(prompt, budget))


def _extra_chunks(model: StepModel, shape: Shape, engine: Engine) -> float:
    """Steps beyond the first for a prompt longer than the token budget."""
    total, offset = 0.0, engine.token_budget
    while offset < shape.prompt:
        tokens = min(engine.token_budget, shape.prompt - offset)
        total += model.step_time(prefill_chunk(tokens, offset)).total_s
        offset += tokens
    return total


def prefill_service_s(model: StepModel, prompt: int, budget: int) -> float:
    """A prefill-only replica's time for one prompt, in chunks of the token budget."""
    total, offset = 0.0, 0
    while offset < prompt:
        tokens = min(budget, prompt - offset)
        total += model.step_time(prefill_chunk(tokens, offset)).total_s
        offset += tokens
    return total


def disaggregated(
    model: StepModel,
    engine: Engine,
    mix_shapes: list[Shape],
    rate: float,
    *,
    prefill: int,
    decode: int,
    link: Link,
    kv_bytes_per_token: float,
) -> Serving:
    """``rate`` requests/s into ``prefill`` prefill and ``decode`` decode replicas."""
    mix = _Mix(mix_shapes)
    ctx = mix.decode_context
    r_d = rate / decode

    def t_dec(batch: float) -> float:
        return model.step_time(decode_step(max(batch, 1.0), ctx)).total_s

    solved = _decode_batch(model, mix, r_d, t_dec)
    services = [prefill_service_s(model, s.prompt, engine.token_budget) for s in mix.shapes]
    shares = [s.share for s in mix.shapes]
    rho = rate / prefill * sum(a * b for a, b in zip(shares, services, strict=True))
    if solved is None or rho >= 1:
        return Serving(rate, math.inf, math.inf, False, math.inf, math.inf)
    step, batch = solved
    # The router sends each prompt to the prefill replica with the least backlog: one
    # queue in front of ``prefill`` servers (M/G/c), not ``prefill`` queues of their own.
    wait = _wait_tail(rate, list(zip(shares, services, strict=True)), prefill)
    fixed = [
        svc + link.transfer_s(s.prompt * kv_bytes_per_token) + 1.5 * step
        for s, svc in zip(mix.shapes, services, strict=True)
    ]

    def ttft_tail(x: float) -> float:
        return sum(a * wait(x - f) for a, f in zip(shares, fixed, strict=True))

    stable = _fits(engine, mix, batch)
    return Serving(rate, _quantile(ttft_tail, P95, max(fixed)), step, stable, batch, step)


def goodput(
    serve: Callable[[float], Serving], ttft_s: float, tpot_s: float, *, per_token: bool = False
) -> float:
    """The largest rate whose serving meets the SLO (latencies grow with rate); 0 if none.

    ``per_token``: the TPOT limit holds for every token gap (ITL p95), not a request's mean.
    """

    def ok(rate: float) -> bool:
        return serve(rate).meets(ttft_s, tpot_s, per_token=per_token)

    low, high = 0.0, 1.0
    if not ok(1e-6):
        return 0.0
    while ok(high):
        low, high = high, high * 2
        if high > 1e6:
            return high
    for _ in range(40):
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return low


class Split(msgspec.Struct, frozen=True):
    prefill: int
    decode: int
    goodput_rps: float


class PDComparison(msgspec.Struct, frozen=True):
    """Colocated vs disaggregated on ``replicas`` replicas of the same GPUs."""

    replicas: int
    per_token: bool  # the TPOT limit read as every token gap (ITL p95), not a request's mean
    colocated_rps: float  # goodput of ``replicas`` colocated replicas
    pd_rps: float  # goodput at the best split
    prefill: int  # the best split
    decode: int
    gain: float  # pd / colocated - 1 (inf when colocated meets the SLO at no rate)
    pays: bool  # gain > PAYS_MARGIN
    splits: list[Split]
    transfer_ms: list[float]  # per class of the mix, KV bytes over the link


def compare(
    model: StepModel,
    engine: Engine,
    mix: list[Shape],
    *,
    replicas: int,
    link: Link,
    kv_bytes_per_token: float,
    ttft_s: float,
    tpot_s: float,
    per_token: bool = False,
) -> PDComparison:
    """Goodput of ``replicas`` colocated replicas and of every ``p:d`` split of them."""
    if replicas < 2:
        raise PlanError(f"--gpus: PD needs at least 2 replicas to split, got {replicas}")
    shapes = normalise(mix)

    def rate_of(serve: Callable[[float], Serving]) -> float:
        return goodput(serve, ttft_s, tpot_s, per_token=per_token)

    colo = rate_of(lambda r: colocated(model, engine, shapes, r / replicas))
    splits = []
    for p in range(1, replicas):

        def split(rate: float, p: int = p) -> Serving:
            return disaggregated(
                model,
                engine,
                shapes,
                rate,
                prefill=p,
                decode=replicas - p,
                link=link,
                kv_bytes_per_token=kv_bytes_per_token,
            )

        rate = rate_of(split)
        splits.append(Split(p, replicas - p, rate))
    best = max(splits, key=lambda s: (s.goodput_rps, -s.prefill))
    gain = best.goodput_rps / colo - 1 if colo > 0 else (math.inf if best.goodput_rps else 0.0)
    return PDComparison(
        replicas=replicas,
        per_token=per_token,
        colocated_rps=colo,
        pd_rps=best.goodput_rps,
        prefill=best.prefill,
        decode=best.decode,
        gain=gain,
        pays=gain > PAYS_MARGIN,
        splits=splits,
        transfer_ms=[link.transfer_s(s.prompt * kv_bytes_per_token) * 1e3 for s in shapes],
    )


class RoleCapacity(msgspec.Struct, frozen=True):
    """What one replica of a prefill or decode pool sustains within its part of the SLO."""

    requests_per_s: float
    in_flight: float  # requests it holds at that rate (Little's law; decode: its batch)
    bound: str  # what stops it: the SLO, the KV cache or max_num_seqs
    met: bool  # False: it misses the SLO even at the lightest load


def prefill_capacity(
    model: StepModel, engine: Engine, mix_shapes: list[Shape], ttft_s: float
) -> RoleCapacity:
    """One prefill-only replica: the largest rate whose TTFT p95 there (the M/G/1 wait for
    the prompts ahead plus its own, in chunks of the token budget) is within ``ttft_s``.
    The KV transfer and the decode's first step come on top of what is counted here."""
    mix = _Mix(mix_shapes)
    shares = [s.share for s in mix.shapes]
    services = [prefill_service_s(model, s.prompt, engine.token_budget) for s in mix.shapes]
    mean = sum(a * x for a, x in zip(shares, services, strict=True))
    second = sum(a * x * x for a, x in zip(shares, services, strict=True))

    def ttft_p95(rate: float) -> float:
        wait = _wait_tail(rate, list(zip(shares, services, strict=True)))
        return _quantile(
            lambda x: sum(a * wait(x - s) for a, s in zip(shares, services, strict=True)),
            P95,
            max(services),
        )

    def at(rate: float, bound: str, met: bool) -> RoleCapacity:
        rho = rate * mean
        wait = rate * second / (2 * (1 - rho)) if rho < 1 else math.inf  # Pollaczek-Khinchine
        return RoleCapacity(rate, rate * (wait + mean), bound, met)

    if ttft_p95(1e-9) > ttft_s:  # at the lightest load
        return at(0.5 / mean, f"its prompt alone takes {max(services):.3g} s", False)
    low, high = 0.0, 1 / mean
    for _ in range(50):
        mid = (low + high) / 2
        if ttft_p95(mid) <= ttft_s:
            low = mid
        else:
            high = mid
    return at(low, f"TTFT p95 {ttft_s:g} s", True)


def decode_capacity(
    model: StepModel, engine: Engine, mix_shapes: list[Shape], tpot_s: float
) -> RoleCapacity:
    """One decode-only replica: the largest batch whose step (``T_d(B)``: no prompt shares
    it) is within ``tpot_s``, capped by the KV cache and max_num_seqs; its rate by Little's
    law, ``B / (O-bar x T_d(B))``."""
    mix = _Mix(mix_shapes)

    def step(batch: int) -> float:
        return model.step_time(decode_step(batch, mix.decode_context)).total_s

    by_kv = int(engine.kv_tokens // mix.decode_context)
    cap, bound = (
        (engine.max_seqs, "max_num_seqs") if engine.max_seqs <= by_kv else (by_kv, "KV cache")
    )
    if cap < 1:
        raise PlanError(
            f"the KV cache ({engine.kv_tokens} tokens) holds no sequence of "
            f"{mix.decode_context:.0f} tokens"
        )
    if step(1) > tpot_s:
        return RoleCapacity(
            1 / (mix.output * step(1)), 1.0, f"TPOT {step(1):.3g} s at batch 1", False
        )
    low, high = 1, cap
    if step(cap) > tpot_s:
        bound = f"TPOT p95 {tpot_s:g} s"
        while high - low > 1:
            mid = (low + high) // 2
            if step(mid) <= tpot_s:
                low = mid
            else:
                high = mid
    else:
        low = cap
    return RoleCapacity(low / (mix.output * step(low)), float(low), bound, True)
