"""Colocated vs disaggregated prefill/decode replicas on the same GPUs, in modelled time.

A discrete-event run of a replica layout against a list of arrivals, with the simulated
engine's own parts: each replica is a ``Scheduler`` (continuous batching, chunked prefill,
prefix cache, preemption) over a ``KVCache``, its steps priced by the planner's step model
(the roofline). Nothing sleeps, so a run is deterministic and takes the CPU time of the
scheduling alone, whatever the modelled GPUs do. Prefix caching is off (the runs' prompts
share nothing; hashing would cost most of the CPU), which also spares the KV events.

Layouts (``Layout``):

- colocated (``prefill == 0``): ``replicas`` replicas, each prefills and decodes; a request
  goes to the replica with the fewest requests (running + waiting).
- disaggregated: ``prefill`` replicas compute prompts only (``max_tokens=1``, as vLLM's PD
  proxy sends them); a finished prompt's KV crosses the ``Link`` (``transfer_s`` of its
  bytes, links uncontended), then a decode replica takes it with the prompt's KV already
  in its cache (blocks allocated, ``num_computed = prompt - 1``: vLLM's connector
  recomputes the last prompt token for its logits), so a decode replica never computes a
  prompt (unless it preempts the request: recompute, as vLLM) and no long prefill stalls
  its steps. The prefill replica is the one with the fewest uncomputed prompt tokens, the
  decode replica the one with the fewest sequences; a transfer waits on that replica while
  its KV blocks are not free, a preempted request waits there, or max_num_seqs are in.
  The client's first token is the decode replica's.

Per request the run records TTFT (arrival to first token), TPOT (its mean token gap) and
every token gap (ITL); per replica, the prompt tokens its steps computed.

Failure mode: the router is an idealised least-loaded pick (no prefix affinity), the KV
stays on the prefill replica for no time after its prompt (vLLM holds it until the pull),
and links never queue: optimistic for PD where those matter.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from hpcserve.planner.pd import Link, Shape, normalise
from hpcserve.sim.kvcache import KVCache
from hpcserve.sim.scheduler import Scheduler, SchedulerLimits, SimRequest, Status, StepPlan
from hpcserve.sim.timing import SimHardware


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: int
    output: int


def poisson_arrivals(mix: list[Shape], rate: float, count: int, *, seed: int = 0) -> list[Arrival]:
    """``count`` arrivals at ``rate``/s (exponential gaps), classes drawn by their shares."""
    rng = random.Random(seed)
    shapes = normalise(mix)
    weights = [s.share for s in shapes]
    now, out = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        shape = rng.choices(shapes, weights)[0]
        out.append(Arrival(now, shape.prompt, shape.output))
    return out


@dataclass(frozen=True)
class Layout:
    """``replicas`` replicas of which ``prefill`` compute prompts only (0: colocated)."""

    replicas: int
    prefill: int = 0
    link: Link | None = None
    kv_bytes_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.prefill and not 0 < self.prefill < self.replicas:
            raise ValueError(
                f"prefill replicas must leave a decode replica: {self.prefill} of {self.replicas}"
            )
        if self.prefill and self.link is None:
            raise ValueError("a disaggregated layout needs a link")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def label(self) -> str:
        if not self.disaggregated:
            return f"colocated x{self.replicas}"
        return f"PD {self.prefill}:{self.replicas - self.prefill}"


@dataclass
class Outcome:
    prompt: int
    output: int
    arrival_s: float
    ttft_s: float = -1.0
    tpot_s: float = -1.0
    gaps: list[float] = field(default_factory=list)  # every token gap, seconds
    scheduled_s: float = -1.0  # when its replica first scheduled it (its queue wait ended)


class _UnhashedKV(KVCache):
    """Prefix caching off (vLLM's --no-enable-prefix-caching): the runs' prompts share no
    prefix, and hashing every block would cost most of a run's CPU time."""

    def lookup(self, request_id: str, token_ids: list[int], salt: str = "") -> int:
        self.allocate(request_id, 0)
        self.queries += len(token_ids)
        return 0

    def commit(self, request_id: str, token_ids: list[int], computed: int) -> None:
        return None


class _Request(SimRequest):
    """A request whose ids the unhashed cache never reads: ``all_ids`` without the copy."""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids


@dataclass
class _Replica:
    index: int
    role: str  # "both", "prefill" or "decode"
    scheduler: Scheduler
    kv: KVCache
    plan: StepPlan | None = None
    pending: list[tuple[SimRequest, Outcome]] = field(default_factory=list)  # KV to admit
    prompt_tokens_computed: int = 0
    busy_s: float = 0.0

    @property
    def load(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting) + len(self.pending)

    @property
    def prefill_backlog(self) -> int:
        s = self.scheduler
        return sum(len(r.prompt_ids) - r.num_computed for r in [*s.running, *s.waiting])


@dataclass
class RunResult:
    layout: str
    outcomes: list[Outcome]
    prompt_tokens_by_role: dict[str, int]
    preemptions: int
    end_s: float


class PDRun:
    """One run of a layout; ``run(arrivals)`` returns every request's outcome."""

    def __init__(self, hw: SimHardware, limits: SchedulerLimits, layout: Layout) -> None:
        self.hw = hw
        self.limits = limits
        self.layout = layout
        self.replicas: list[_Replica] = []
        for i in range(layout.replicas):
            role = "both"
            if layout.disaggregated:
                role = "prefill" if i < layout.prefill else "decode"
            kv = _UnhashedKV(hw.kv_blocks, hw.block_size)
            sched = Scheduler(kv, limits, lambda req: 0)
            self.replicas.append(_Replica(i, role, sched, kv))
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._token_ids = itertools.count(1)
        self._outcomes: dict[str, Outcome] = {}
        self._last_token: dict[str, float] = {}

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def _prompt_ids(self, n: int) -> list[int]:
        # Distinct ids per request: no prefix is shared, so no prompt is served from cache.
        return [next(self._token_ids)] * n

    def run(self, arrivals: list[Arrival]) -> RunResult:
        for a in arrivals:
            self._push(a.at_s, "arrive", a)
        now = 0.0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                assert isinstance(payload, Arrival)
                self._arrive(payload, now)
            elif kind == "step":
                assert isinstance(payload, _Replica)
                self._step_done(payload, now)
            else:
                assert isinstance(payload, tuple)
                self._transferred(payload[0], payload[1], now)
        by_role: dict[str, int] = {}
        for r in self.replicas:
            by_role[r.role] = by_role.get(r.role, 0) + r.prompt_tokens_computed
        return RunResult(
            self.layout.label,
            list(self._outcomes.values()),
            by_role,
            sum(r.scheduler.preemptions for r in self.replicas),
            now,
        )

    def _arrive(self, a: Arrival, now: float) -> None:
        outcome = Outcome(a.prompt, a.output, a.at_s)
        prompt = self._prompt_ids(a.prompt)
        rid = f"r{next(self._ids)}"
        self._outcomes[rid] = outcome
        if self.layout.disaggregated:
            targets = [r for r in self.replicas if r.role == "prefill"]
            replica = min(targets, key=lambda r: (r.prefill_backlog, r.index))
            req = _Request(rid, prompt, 1, now)
        else:
            replica = min(self.replicas, key=lambda r: (r.load, r.index))
            req = _Request(rid, prompt, a.output, now)
        replica.scheduler.add(req)
        self._kick(replica, now)

    def _kick(self, replica: _Replica, now: float) -> None:
        """Start a step on an idle replica that has work."""
        if replica.plan is not None or not replica.scheduler.has_work:
            return
        plan = replica.scheduler.schedule(now)
        if plan.empty:
            return
        dt = self.hw.step_model.step_time(plan.batch).total_s
        replica.plan = plan
        replica.busy_s += dt
        replica.prompt_tokens_computed += int(plan.batch.prefill_tokens)
        self._push(now + dt, "step", replica)

    def _step_done(self, replica: _Replica, now: float) -> None:
        plan, replica.plan = replica.plan, None
        assert plan is not None
        for req, token in replica.scheduler.complete(plan, now):
            if token is None:
                continue
            outcome = self._outcomes[req.request_id]
            if replica.role == "prefill":
                # The prompt is done: its KV goes to a decode replica.
                assert self.layout.link is not None
                nbytes = len(req.prompt_ids) * self.layout.kv_bytes_per_token
                self._push(now + self.layout.link.transfer_s(nbytes), "transfer", (req, outcome))
                continue
            self._token(req, outcome, now)
        self._admit_pending(replica, now)
        self._kick(replica, now)

    def _token(self, req: SimRequest, outcome: Outcome, now: float) -> None:
        last = self._last_token.get(req.request_id)
        if last is None:
            outcome.ttft_s = now - outcome.arrival_s
            outcome.scheduled_s = req.scheduled_s
        else:
            outcome.gaps.append(now - last)
        self._last_token[req.request_id] = now
        if req.status is Status.FINISHED:
            del self._last_token[req.request_id]
            if outcome.gaps:
                outcome.tpot_s = sum(outcome.gaps) / len(outcome.gaps)

    def _transferred(self, prefilled: SimRequest, outcome: Outcome, now: float) -> None:
        targets = [r for r in self.replicas if r.role == "decode"]
        replica = min(targets, key=lambda r: (r.load, r.index))
        req = _Request(
            prefilled.request_id, prefilled.prompt_ids, outcome.output, outcome.arrival_s
        )
        replica.pending.append((req, outcome))
        self._admit_pending(replica, now)
        self._kick(replica, now)

    def _admit_pending(self, replica: _Replica, now: float) -> None:
        """Write transferred KV into the decode replica's cache while blocks are free.

        Not while a preempted request waits there (it goes first: waiting requests holding
        blocks behind it could starve it of them), nor beyond max_num_seqs in the scheduler.
        """
        sched = replica.scheduler
        while replica.pending:
            if len(sched.running) + len(sched.waiting) >= self.limits.max_num_seqs:
                return
            if any(not replica.kv.holds(r.request_id) for r in sched.waiting):
                return
            req, _ = replica.pending[0]
            prompt = len(req.prompt_ids)
            if not replica.kv.allocate(req.request_id, prompt):
                replica.kv.free(req.request_id)
                return
            replica.kv.commit(req.request_id, req.prompt_ids, prompt)
            req.num_computed = prompt - 1
            req.cached_tokens = prompt - 1
            replica.pending.pop(0)
            replica.scheduler.add(req)


def percentile(values: list[float], q: float) -> float:
    """Linear between the closest ranks, as bench/workload.py counts; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


@dataclass(frozen=True)
class Latencies:
    requests: int
    ttft_p95_s: float
    tpot_p95_s: float  # of each request's mean token gap
    itl_p95_s: float  # of every token gap
    # The queue still grows at the end: the TTFT median of the last fifth of the kept
    # requests is over twice (and 100 ms above) the first fifth's. A run of finite length
    # can meet an SLO above capacity; this says it would not for long.
    growing: bool = False

    def meets(self, ttft_s: float, tpot_s: float, *, per_token: bool = False) -> bool:
        tpot = self.itl_p95_s if per_token else self.tpot_p95_s
        return not self.growing and self.ttft_p95_s <= ttft_s and tpot <= tpot_s


def latencies(result: RunResult, *, warmup: float = 0.2, cooldown: float = 0.1) -> Latencies:
    """p95s over the requests in steady state: without the first ``warmup`` share (the
    fleet filling up) and the last ``cooldown`` share (the fleet draining)."""
    ordered = sorted(result.outcomes, key=lambda o: o.arrival_s)
    kept = ordered[int(len(ordered) * warmup) : len(ordered) - int(len(ordered) * cooldown)]
    if any(o.ttft_s < 0 for o in kept):
        raise RuntimeError(f"{result.layout}: a request never got its first token")
    gaps = [g for o in kept for g in o.gaps]
    fifth = max(1, len(kept) // 5)
    first = percentile([o.ttft_s for o in kept[:fifth]], 0.5)
    last = percentile([o.ttft_s for o in kept[-fifth:]], 0.5)
    return Latencies(
        len(kept),
        percentile([o.ttft_s for o in kept], 0.95),
        percentile([o.tpot_s for o in kept if o.tpot_s >= 0], 0.95),
        percentile(gaps, 0.95),
        growing=last > 2 * first and last > first + 0.1,
    )
