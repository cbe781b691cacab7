"""Continuous batching with a token budget per step, as vLLM v1's scheduler does it.

Each step the scheduler fills a budget of ``max_num_batched_tokens``: first the running
requests (one token each when decoding, a chunk of the rest when still prefilling), then
waiting requests in arrival order while fewer than ``max_num_seqs`` run. A waiting request
starts on its cached prefix (the KV cache's prefix lookup), so only the uncached part of
its prompt is computed. When a running request needs a block and none is free, the
request that started last is preempted: its blocks are freed (they stay cached until
evicted) and it goes back to the head of the queue, to be recomputed (vLLM's default,
recompute preemption); no new request is admitted in a step that preempted.

With ``policy="priority"`` (vLLM's ``--scheduling-policy priority``) the waiting queue is
ordered by (priority, arrival): a lower value is served first, ties first come first
served, and a preempted request goes back to its place in that order rather than to the
head. The victim of a preemption is then the running request with the highest
(priority, arrival), the lowest-priority latest arrival, even if it was already scheduled
in this step (its tokens go back to the budget). As in vLLM, a waiting request never
preempts a running one: priority decides who is admitted next and who yields KV blocks,
not who shares a step. Under ``fcfs`` the priority is ignored.

``schedule()`` returns a ``StepPlan`` whose ``batch`` is the planner's ``StepBatch``, so a
``StepModel`` prices the step; ``complete(plan)`` then advances every request in it and
samples one token for each request whose known tokens are all computed.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hpcserve.planner.perfmodel import StepBatch, decode_step, prefill_chunk
from hpcserve.sim.kvcache import KVCache


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SimRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    preemptions: int = 0
    scheduled_s: float = -1.0  # first time it was scheduled (queue time ends)
    first_token_s: float = -1.0
    last_token_s: float = -1.0
    finished_s: float = -1.0
    finish_reason: str = ""
    started: bool = False
    priority: int = 0  # lower first, under the priority policy
    cache_salt: str = ""  # its blocks are shared only with requests of the same salt
    order: int = 0  # set by the scheduler: breaks ties of equal arrival times
    # Disaggregated decode (sim/transfer.py): its prompt's KV cache came from a prefill
    # replica, so it starts with the prompt computed but the last token; external_tokens:
    # the prompt tokens that came that way (set when first scheduled).
    remote_kv: bool = False
    external_tokens: int = 0
    remote_decode: bool = False  # a prefill step: it answers kv_transfer_params
    block_ids: list[int] = field(default_factory=list)  # the blocks it held when it finished

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class Scheduled:
    request: SimRequest
    tokens: int  # tokens computed for it in this step
    offset: int  # tokens it had computed before this step


@dataclass(frozen=True)
class StepPlan:
    scheduled: list[Scheduled]
    batch: StepBatch
    preempted: list[SimRequest]

    @property
    def empty(self) -> bool:
        return not self.scheduled


POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    policy: str = "fcfs"  # or "priority": vLLM's --scheduling-policy


def _rank(req: SimRequest) -> tuple[int, float, int]:
    return (req.priority, req.arrival_s, req.order)


class WaitingQueue:
    """Requests waiting to run: arrival order (fcfs), or (priority, arrival) order."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r}; allowed: {', '.join(POLICIES)}")
        self.by_priority = policy == "priority"
        self._queue: deque[SimRequest] = deque()
        self._sorted: list[SimRequest] = []

    def add(self, req: SimRequest) -> None:
        if self.by_priority:
            bisect.insort(self._sorted, req, key=_rank)
        else:
            self._queue.append(req)

    def add_preempted(self, req: SimRequest) -> None:
        if self.by_priority:
            self.add(req)
        else:
            self._queue.appendleft(req)

    def peek(self) -> SimRequest:
        return self._sorted[0] if self.by_priority else self._queue[0]

    def pop(self) -> SimRequest:
        return self._sorted.pop(0) if self.by_priority else self._queue.popleft()

    def remove(self, req: SimRequest) -> None:
        (self._sorted if self.by_priority else self._queue).remove(req)

    def __contains__(self, req: object) -> bool:
        return req in (self._sorted if self.by_priority else self._queue)

    def __iter__(self) -> Iterator[SimRequest]:
        return iter(self._sorted if self.by_priority else self._queue)

    def __len__(self) -> int:
        return len(self._sorted) if self.by_priority else len(self._queue)


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        limits: SchedulerLimits,
        next_token: Callable[[SimRequest], int],
    ) -> None:
        self.kv = kv
        self.limits = limits
        self.next_token = next_token
        self.waiting = WaitingQueue(limits.policy)
        self.running: list[SimRequest] = []
        self.preemptions = 0
        self._order = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        self.check(request)
        request.order = next(self._order)
        self.waiting.add(request)

    def check(self, request: SimRequest) -> None:
        """ValueError when the request can never run here."""
        if len(request.prompt_ids) >= self.limits.max_model_len:
            raise ValueError(
                f"prompt of {len(request.prompt_ids)} tokens leaves no room for output within "
                f"max_model_len {self.limits.max_model_len}"
            )
        if -(-len(request.prompt_ids) // self.kv.block_size) > self.kv.num_blocks:
            raise ValueError(
                f"prompt of {len(request.prompt_ids)} tokens needs more KV blocks than the "
                f"cache has ({self.kv.num_blocks} of {self.kv.block_size} tokens)"
            )

    def abort(self, request: SimRequest, reason: str = "abort") -> None:
        if request.status is Status.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, reason, -1.0)

    def schedule(self, now_s: float = 0.0) -> StepPlan:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted: list[SimRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            tokens = min(req.num_tokens - req.num_computed, budget)
            while not self.kv.allocate(req.request_id, req.num_computed + tokens):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:  # already scheduled in this step: its tokens go back
                    i -= 1
                    item = next(x for x in scheduled if x.request is victim)
                    scheduled.remove(item)
                    budget += item.tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(Scheduled(req, tokens, req.num_computed))
                budget -= tokens
                i += 1
                continue
            break
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.limits.max_num_seqs
        ):
            req = self.waiting.peek()
            if not self.kv.holds(req.request_id):
                cached = self.kv.lookup(req.request_id, req.all_ids, req.cache_salt)
                req.num_computed = cached
                if not req.started:
                    req.cached_tokens = cached
                    if req.remote_kv:  # loaded, not computed: all but the last token
                        req.num_computed = max(cached, len(req.prompt_ids) - 1)
                        req.external_tokens = len(req.prompt_ids) - cached
            tokens = min(req.num_tokens - req.num_computed, budget)
            if not self.kv.allocate(req.request_id, req.num_computed + tokens):
                # All or nothing, as vLLM allocates: a waiting request that kept the cached
                # blocks it found could starve the running ones of them (a deadlock).
                self.kv.free(req.request_id)
                req.num_computed = 0
                break
            self.waiting.pop()
            req.status = Status.RUNNING
            if not req.started:
                req.started, req.scheduled_s = True, now_s
            self.running.append(req)
            scheduled.append(Scheduled(req, tokens, req.num_computed))
            budget -= tokens
        batch = StepBatch()
        for item in scheduled:
            batch = batch + self._work(item.request, item.tokens)
        return StepPlan(scheduled, batch, preempted)

    def _victim(self) -> SimRequest:
        """The running request to preempt: the last started (fcfs), or the lowest-priority
        latest arrival (priority)."""
        if self.waiting.by_priority:
            return max(self.running, key=_rank)
        return self.running[-1]

    def complete(self, plan: StepPlan, now_s: float) -> list[tuple[SimRequest, int | None]]:
        """Advance the requests of ``plan``; one (request, new token or None) for each."""
        out: list[tuple[SimRequest, int | None]] = []
        for item in plan.scheduled:
            req = item.request
            if req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            req.num_computed = item.offset + item.tokens
            self.kv.commit(req.request_id, req.all_ids, req.num_computed)
            if req.num_computed < req.num_tokens:
                out.append((req, None))  # a prefill chunk; more to come
                continue
            token = self.next_token(req)
            req.output_ids.append(token)
            if req.first_token_s < 0:
                req.first_token_s = now_s
            out.append((req, token))
            done = len(req.output_ids) >= req.max_tokens
            if done or req.num_tokens >= self.limits.max_model_len:
                self._finish_running(req, "length", now_s)
        return out

    def _work(self, req: SimRequest, tokens: int) -> StepBatch:
        if req.num_computed + tokens == req.num_tokens and tokens == 1 and req.output_ids:
            return decode_step(1, req.num_computed)
        return prefill_chunk(tokens, req.num_computed)

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.request_id)
        req.num_computed = 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.add_preempted(req)

    def _finish_running(self, req: SimRequest, reason: str, now_s: float) -> None:
        self.running.remove(req)
        self._finish(req, reason, now_s)

    def _finish(self, req: SimRequest, reason: str, now_s: float) -> None:
        req.block_ids = self.kv.blocks_of(req.request_id)
        self.kv.free(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_s = now_s
