"""The simulated engine core: a step loop on asyncio that stands in for vLLM's EngineCore.

Each iteration asks the scheduler for a step, prices it with the step model (the planner's
roofline, or fixed timing), sleeps that long times ``time_scale`` (0.01: a hundred times
faster than the modelled GPU), then completes the step: tokens go to the requests'
streams, finished requests are counted, and the KV cache's stored/removed blocks are
published as one KV-event batch, as vLLM publishes one per step. Times inside the engine
(metrics, request timestamps) are modelled seconds: wall seconds / ``time_scale``.

Failure mode: the loop is cooperative; when the host process is short of CPU, steps end
late and modelled time runs slower than the wall clock says (the loop never catches up by
skipping steps). Requests already arriving when the loop stops are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.protocol import ReplicaLoad
from hpcserve.sim.kvcache import Cleared, KVCache, KVEvent, Removed, Stored
from hpcserve.sim.metrics import SimMetrics
from hpcserve.sim.scheduler import Scheduler, SchedulerLimits, SimRequest, Status, StepPlan
from hpcserve.sim.timing import SimHardware
from hpcserve.sim.tokenizer import SimTokenizer
from hpcserve.sim.transfer import KVTransferConfig, prefill_answer, remote_decode, remote_prefill

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # what vLLM reports for its own KV cache, on CPU builds too


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config, the part the simulator honours."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass(frozen=True)
class SimConfig:
    served_model_name: str
    hardware: SimHardware
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    time_scale: float = 1.0
    kv_events: KVEventsConfig | None = None
    default_max_tokens: int = 16
    # A file to append one JSON line per finished request to (--request-trace): what the
    # replica was doing when the request arrived, and its timeline; "" for none.
    request_trace: str = ""
    # Fault injection (--sim-error-rate): this share of completion requests is answered
    # 500 before any token, as an engine that fails would.
    error_rate: float = 0.0
    # A KV-transfer connector (--kv-transfer-config, sim/transfer.py): a prefill replica
    # answers kv_transfer_params, a decode replica loads a prompt instead of computing it.
    kv_transfer: KVTransferConfig | None = None
    # vLLM's --stream-interval: a stream sends the first token at once, then every this many
    # tokens (and the last), fewer events for the same tokens.
    stream_interval: int = 1


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str
    index: int  # 0 for the first output token
    finish_reason: str | None  # set on the last token


class EngineClosed(RuntimeError):
    pass


def wire_events(events: list[KVEvent]) -> list[kw.KVEvent]:
    out: list[kw.KVEvent] = []
    for event in events:
        match event:
            case Stored():
                out.append(
                    kw.BlockStored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=event.token_ids,
                        block_size=event.block_size,
                        medium=MEDIUM,
                        # vLLM's: one entry per block; the salt in the first block's
                        extra_keys=[(event.salt,)] + [None] * (len(event.block_hashes) - 1)
                        if event.salt
                        else None,
                        group_idx=0,
                    )
                )
            case Removed():
                out.append(kw.BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM))
            case Cleared():
                out.append(kw.AllBlocksCleared())
    return out


class SimEngine:
    def __init__(self, config: SimConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        hw = config.hardware
        self.kv = KVCache(hw.kv_blocks, hw.block_size)
        self.scheduler = Scheduler(self.kv, config.limits, self._next_token)
        self.metrics = SimMetrics(config.served_model_name)
        self._filler = tokenizer.filler_ids() or [0]
        self._streams: dict[str, asyncio.Queue[TokenOut | None]] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._publisher: kw.KVEventPublisher | None = None
        self._t0 = time.monotonic()
        self.steps = 0
        self.busy_s = 0.0
        # Request id -> what the replica was doing when it arrived (--request-trace only).
        self._arrived: dict[str, dict[str, object]] = {}
        # Decode requests whose prompt's KV cache is on its way (sim/transfer.py).
        self._loading: set[asyncio.Task[None]] = set()

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        if self.config.kv_events is not None:
            ev = self.config.kv_events
            self._publisher = kw.KVEventPublisher(
                ev.endpoint, replay_endpoint=ev.replay_endpoint, topic=ev.topic
            )
        self._t0 = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        for loading in list(self._loading):
            loading.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for queue in self._streams.values():
            queue.put_nowait(None)
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None

    def now(self) -> float:
        """Modelled seconds since the engine started."""
        return (time.monotonic() - self._t0) / self.config.time_scale

    # -- requests ---------------------------------------------------------------------------

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            running=len(self.scheduler.running),
            waiting=self.waiting,
            kv_usage=self.kv.usage,
            # As the engine agent reports a real vLLM's (num_gpu_blocks x block_size).
            kv_capacity_tokens=self.kv.num_blocks * self.kv.block_size,
        )

    @property
    def waiting(self) -> int:
        """Requests waiting, those whose KV cache is on its way included (as vLLM counts
        its WAITING_FOR_REMOTE_KVS requests)."""
        return len(self.scheduler.waiting) + len(self._loading)

    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        priority: int = 0,
        kv_params: Mapping[str, Any] | None = None,
        cache_salt: str = "",
    ) -> SimRequest:
        """Queue a request (ValueError when it can never fit); read it with ``stream``.
        ``priority`` (lower first) counts under the priority policy only, as in vLLM.
        ``kv_params``: the request's kv_transfer_params (used with a connector only)."""
        if self._wake is None:
            raise EngineClosed("the engine is not running")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        room = self.config.limits.max_model_len - len(prompt_ids)
        if max_tokens > room:
            raise ValueError(
                f"This model's maximum context length is {self.config.limits.max_model_len} "
                f"tokens. However, you requested {len(prompt_ids) + max_tokens} tokens "
                f"({len(prompt_ids)} in the messages, {max_tokens} in the completion)."
            )
        req = SimRequest(
            f"sim-{next(self._ids)}",
            list(prompt_ids),
            max_tokens,
            self.now(),
            priority=priority,
            cache_salt=cache_salt,
        )
        if self.config.request_trace:
            self._arrived[req.request_id] = self._state_at_arrival()
        transfer = self.config.kv_transfer
        if transfer is not None and remote_prefill(kv_params):
            self.scheduler.check(req)
            req.remote_kv = True
            self._streams[req.request_id] = asyncio.Queue()
            task = asyncio.get_running_loop().create_task(self._load(req, transfer))
            self._loading.add(task)
            task.add_done_callback(self._loading.discard)
            return req
        if transfer is not None and remote_decode(kv_params):
            req.remote_decode = True
        self.scheduler.add(req)
        self._streams[req.request_id] = asyncio.Queue()
        self._wake.set()
        return req

    async def _load(self, req: SimRequest, transfer: KVTransferConfig) -> None:
        """Move the prompt's KV cache from the prefill replica (modelled: the link's time
        for the tokens this replica's prefix cache lacks), then queue the request."""
        bs = self.kv.block_size
        local = len(self.kv.cached_prefix_blocks(req.prompt_ids, req.cache_salt)) * bs
        nbytes = (len(req.prompt_ids) - local) * self.config.hardware.kv_bytes_per_token
        seconds = transfer.transfer_s(nbytes)
        await asyncio.sleep(seconds * self.config.time_scale)
        self.metrics.observe_transfer(seconds, nbytes)
        if req.status is Status.FINISHED or self._wake is None:
            return  # aborted while its KV cache was on its way
        self.scheduler.add(req)
        self._wake.set()

    def kv_transfer_answer(self, req: SimRequest) -> dict[str, Any] | None:
        """The kv_transfer_params a finished request answers with (None: none)."""
        transfer = self.config.kv_transfer
        if transfer is None or not req.remote_decode:
            return None
        return prefill_answer(transfer, req.request_id, req.block_ids, len(req.prompt_ids))

    def _state_at_arrival(self) -> dict[str, object]:
        sched = self.scheduler
        queued = list(sched.running) + list(sched.waiting)
        return {
            "wall_s": time.time(),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            # Prompt tokens not yet computed by the requests ahead (an upper bound for the
            # waiting ones: their cached prefix is found when they are scheduled).
            "prefill_ahead": sum(max(len(r.prompt_ids) - r.num_computed, 0) for r in queued),
        }

    def _trace(self, req: SimRequest) -> None:
        record = {
            "replica": self.config.kv_events.topic if self.config.kv_events else "",
            "prompt": len(req.prompt_ids),
            "prompt_hash": hash(tuple(req.prompt_ids)),
            "cached": req.cached_tokens,
            "queue_s": max(req.scheduled_s - req.arrival_s, 0.0),
            "ttft_s": req.first_token_s - req.arrival_s if req.first_token_s >= 0 else -1.0,
            "preemptions": req.preemptions,
            **self._arrived.pop(req.request_id, {}),
        }
        with open(self.config.request_trace, "a") as out:
            out.write(json.dumps(record) + "\n")

    async def stream(self, req: SimRequest) -> AsyncIterator[TokenOut]:
        """The request's tokens as steps produce them; aborts the request if abandoned."""
        queue = self._streams[req.request_id]
        try:
            while True:
                item = await queue.get()
                if item is None:
                    raise EngineClosed("the engine stopped")
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._streams.pop(req.request_id, None)
            if req.status is not Status.FINISHED:
                self.scheduler.abort(req)
                req.finished_s = self.now()
                self.metrics.observe_finished(req)
                if self.config.request_trace:
                    self._trace(req)

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset()
        if ok and self._wake is not None:
            self._wake.set()  # published with the next step, as vLLM does
        return ok

    # -- the loop ---------------------------------------------------------------------------

    def _next_token(self, req: SimRequest) -> int:
        return self._filler[len(req.output_ids) % len(self._filler)]

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        step_end = loop.time()
        while True:
            self._publish()
            if not self.scheduler.has_work:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.5)
                step_end = loop.time()
                continue
            plan = self.scheduler.schedule(self.now())
            if plan.empty:
                # Waiting requests and no KV room while nothing runs: cannot happen for a
                # request that passed submit(); yield the loop rather than spin.
                await asyncio.sleep(0.001)
                continue
            dt = self.config.hardware.step_model.step_time(plan.batch).total_s
            self.busy_s += dt
            step_end = max(step_end, loop.time()) + dt * self.config.time_scale
            await asyncio.sleep(max(step_end - loop.time(), 0))
            self._complete(plan)

    def _complete(self, plan: StepPlan) -> None:
        now = self.now()
        self.steps += 1
        decoded = 0
        prompt_tokens = 0
        for req, token in self.scheduler.complete(plan, now):
            if token is None:
                continue
            decoded += 1
            if len(req.output_ids) == 1:
                prompt_tokens += len(req.prompt_ids)  # vLLM counts a prompt at its first token
                self.metrics.observe_prompt(req)
            else:
                self.metrics.itl.observe(now - req.last_token_s)
            req.last_token_s = now
            finished = req.status is Status.FINISHED
            queue = self._streams.get(req.request_id)
            if queue is not None:
                queue.put_nowait(
                    TokenOut(
                        token,
                        self.tokenizer.decode([token]),
                        len(req.output_ids) - 1,
                        req.finish_reason if finished else None,
                    )
                )
            if finished:
                self.metrics.observe_finished(req)
                if self.config.request_trace:
                    self._trace(req)
        m = self.metrics
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(decoded)
        m.preemptions.inc(len(plan.preempted))
        m.observe_cache(self.kv.queries, self.kv.hits)
        m.observe_state(len(self.scheduler.running), self.waiting, self.kv.usage)

    def _publish(self) -> None:
        events = self.kv.take_events()
        if self._publisher is None:
            return
        if events:
            self._publisher.publish(wire_events(events))
        else:
            self._publisher.service_replay()
