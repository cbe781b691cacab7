"""Executes batches: every active batch in the store, resumed after any restart.

One task per batch walks its input file, skipping lines that already have a stored
result, and starts a request per line when its model has a free slot (`PoolSlots`, their
number adapted to the engines' queues) and its tenant has batch tokens left
(`BatchTokens`, counted across gateways). Finished requests go to one committer
task, which stores them in group commits; a result counts only once committed. A batch
ends when every line has a result (completed), or when it is cancelled or its window
passes (no new requests; those in flight finish; then cancelled or expired, with the
lines that never ran in the error file).

Failure modes: a crash loses only the results not yet committed; those lines run again
on restart, so an engine may see a request twice but the output holds it once. Only the
holder of the runner lock (lock.py: a `hpcserve batch-runner` process, or a gateway)
runs batches; the others serve the API, wait for the lock and say, in their log and
`hpcserve_batch_waiting_without_runner`, when batches wait and nobody holds it. A standby
gateway hands the lock to a runner process that appears: its batches stop taking new
lines, the requests in flight finish and are stored, then it lets go (a hand-over redoes
no request).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from hpcserve.config import BatchConfig, TenantConfig
from hpcserve.contracts.usage import UsageRecord
from hpcserve.gateway.batch.concurrency import ADAPT_S
from hpcserve.gateway.batch.execute import EngineReply, Executor, NoReplica, ReplicaFailed
from hpcserve.gateway.batch.limiter import BatchTokens
from hpcserve.gateway.batch.lock import RunnerLock
from hpcserve.gateway.batch.slots import ModelLoad, ModelSlots, PoolSlots
from hpcserve.gateway.batch.store import ACTIVE, BatchError, BatchRecord, BatchStore, Result
from hpcserve.gateway.batch.validate import RequestLine, request_line_decoder
from hpcserve.gateway.quota import QuotaGate
from hpcserve.gateway.usage_log import UsageLog

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the store is read for new and cancelled batches (other processes')
COMMIT_MAX = 512
NO_REPLICA_WAIT_MAX_S = 5.0
WATCH_S = 1.0  # a process not holding the lock checks that someone does this often
HANDOVER_WAIT_S = 60.0  # a hand-over lets requests in flight finish this long, then drops them
HANDOVER = "handover"  # a BatchJob's stop reason: another process goes on with the batch


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "hpcserve_batch_requests_total",
            "Batch requests finished, by outcome (completed, failed)",
            ["outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "hpcserve_batch_retries_total",
            "Batch requests retried after a replica failure",
            registry=registry,
        )
        self.tokens = Counter(
            "hpcserve_batch_tokens_total",
            "Tokens of finished batch requests, by kind (input, output) and the model asked for",
            ["kind", "model"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "hpcserve_batch_in_flight", "Batch requests sent to engines now", registry=registry
        )
        self.active = Gauge(
            "hpcserve_batch_active", "Batches this process is running", registry=registry
        )
        self.limit = Gauge(
            "hpcserve_batch_concurrency_per_replica",
            "Batch requests allowed in flight per replica of a model (adapted to the engines)",
            ["model"],
            registry=registry,
        )
        self.lock_held = Gauge(
            "hpcserve_batch_runner_lock_held",
            "1 while this process holds the batch runner lock (runs the batches)",
            registry=registry,
        )
        self.unrun = Gauge(
            "hpcserve_batch_waiting_without_runner",
            "Active batches while no process holds the batch runner lock (seen twice in a row)",
            registry=registry,
        )


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # a /v1/responses line's Response object counts them so
    input_tokens: int = 0
    output_tokens: int = 0


class _Reply(msgspec.Struct):
    usage: _Usage | None = None


_reply = msgspec.json.Decoder(_Reply)


class _Model(msgspec.Struct):
    model: str = ""


_model = msgspec.json.Decoder(_Model)


def result_of(number: int, custom_id: str, request_id: str, reply: EngineReply) -> Result:
    """A stored result from an engine's answer; a body that is not JSON is kept as a string."""
    body = reply.body
    try:
        usage = _reply.decode(body).usage or _Usage()
    except msgspec.DecodeError:
        body, usage = msgspec.json.encode(body.decode("utf-8", "replace")), _Usage()
    return Result(
        line=number,
        custom_id=custom_id,
        status_code=reply.status_code,
        request_id=request_id,
        body=body,
        input_tokens=usage.prompt_tokens or usage.input_tokens,
        output_tokens=usage.completion_tokens or usage.output_tokens,
    )


class Committer:
    """Stores results in group commits; `record` returns once its result is on disk."""

    def __init__(self, store: BatchStore, metrics: BatchMetrics) -> None:
        self._store = store
        self._metrics = metrics
        self._queue: asyncio.Queue[tuple[str, Result, asyncio.Future[None], str]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-committer")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def record(self, batch_id: str, result: Result, model: str = "") -> None:
        """model: what the line asked for (its tokens' label)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put((batch_id, result, done, model))
        await done

    async def _run(self) -> None:
        while True:
            items = [await self._queue.get()]
            while len(items) < COMMIT_MAX and not self._queue.empty():
                items.append(self._queue.get_nowait())
            by_batch: dict[str, list[Result]] = {}
            for batch_id, result, _, _ in items:
                by_batch.setdefault(batch_id, []).append(result)
            try:
                await asyncio.to_thread(self._commit, by_batch)
            except Exception as err:  # disk full, ...: those lines run again later
                log.error("storing %d batch results failed: %s", len(items), err)
                for _, _, done, _ in items:
                    if not done.done():
                        done.set_exception(err)
                continue
            for _, result, done, model in items:
                self._metrics.requests.labels("completed" if result.succeeded else "failed").inc()
                self._metrics.tokens.labels("input", model).inc(result.input_tokens)
                self._metrics.tokens.labels("output", model).inc(result.output_tokens)
                if not done.done():
                    done.set_result(None)

    def _commit(self, by_batch: dict[str, list[Result]]) -> None:
        for batch_id, results in by_batch.items():
            self._store.record_results(batch_id, results)


class _Stop(Exception):
    pass


class BatchJob:
    def __init__(self, runner: BatchRunner, record: BatchRecord) -> None:
        self.runner = runner
        self.record = record
        self.reason: str | None = None  # "cancelled" or "expired" once stopping
        self._stopped = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()

    def stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            log.info("batch %s: stopping (%s)", self.record.id, reason)
        self._stopped.set()

    async def _unless_stopped(self, wait: Callable[[], Awaitable[object]]) -> None:
        """Await wait() unless the batch stops first (then raise _Stop)."""
        if self.reason is not None:
            raise _Stop
        waiter = asyncio.ensure_future(wait())
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait((waiter, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not waiter.done():
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            raise _Stop
        waiter.result()

    def abort(self) -> None:
        """Drop the requests in flight (gateway shutdown): they run again at the next start."""
        for task in list(self._in_flight):
            task.cancel()

    async def run(self) -> None:
        store = self.runner.store
        # The record the supervisor saw may be stale: this batch may have just ended.
        record = self.record = await asyncio.to_thread(store.get_batch, self.record.id)
        if record.status not in ACTIVE:
            return
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(max(0.0, record.expires_at - time.time()), self.stop, "expired")
        try:
            if record.status == "cancelling":
                self.stop("cancelled")
            if record.status == "validating" and self.reason is None:
                problems = await asyncio.to_thread(self.runner.check_input, record)
                if problems:
                    final = await asyncio.to_thread(
                        store.update_batch,
                        record.id,
                        status="failed",
                        failed_at=int(time.time()),
                        errors=problems,
                    )
                    log.info("batch %s: failed validation (%s)", record.id, problems[0].message)
                    self.record = final
                    return
                record = self.record = await asyncio.to_thread(
                    store.update_batch,
                    record.id,
                    status="in_progress",
                    in_progress_at=int(time.time()),
                )
                log.info("batch %s: in_progress, %d requests", record.id, record.total)
            if record.status == "in_progress":
                await self._execute()
            if self.reason == HANDOVER:
                log.info("batch %s: handed over with its results stored", record.id)
                return
            await self._finish()
        finally:
            expiry.cancel()

    async def _execute(self) -> None:
        record = self.record
        done = await asyncio.to_thread(self.runner.store.done_lines, record.id)
        try:
            async with contextlib.aclosing(self._pending_lines(done)) as lines:
                await self._dispatch(lines)
        except _Stop:
            pass
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    async def _dispatch(self, lines: AsyncIterator[tuple[int, _Line]]) -> None:
        record = self.record
        async for number, line in lines:
            slots = self.runner.slots.for_model(line.model)
            await self._unless_stopped(slots.acquire)
            try:
                await self._unless_stopped(lambda: self.runner.batch_tokens.admit(record.tenant))
            except _Stop:
                slots.release()
                raise
            task = asyncio.create_task(self._one(number, line.request, line.model, slots))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _pending_lines(self, done: set[int]) -> AsyncGenerator[tuple[int, _Line]]:
        lines = self.runner.store.input_lines(self.record.input_file_id)
        chunk = 256

        def next_chunk() -> list[tuple[int, _Line]]:
            out: list[tuple[int, _Line]] = []
            for number, raw in lines:
                if number in done:
                    continue
                request = request_line_decoder.decode(raw)
                out.append((number, _Line(request, _model.decode(request.body).model)))
                if len(out) == chunk:
                    break
            return out

        try:
            while batch := await asyncio.to_thread(next_chunk):
                for item in batch:
                    yield item
        finally:
            lines.close()

    def _usage(self, started: float, model: str, reply: EngineReply, result: Result) -> UsageRecord:
        return UsageRecord(
            start=round(started, 3),
            end=round(time.time(), 3),
            tenant=self.record.tenant,
            model=model,
            prompt_tokens=result.input_tokens,
            completion_tokens=result.output_tokens,
            status=reply.status_code,
            replica=reply.replica_id,
            version=reply.version,
            adapter=reply.adapter,
            request_id=result.request_id,
            source="batch",
        )

    async def _one(self, number: int, request: RequestLine, model: str, slots: ModelSlots) -> None:
        runner = self.runner
        request_id = f"req_{secrets.token_hex(12)}"
        attempts = 0
        exclude: list[str] = []
        result: Result | None = None
        body = bytes(request.body)
        try:
            tenant = self.record.tenant
            hints = await runner.executor.route_hints(model, request.url, body, tenant)
            while result is None:
                try:
                    runner.metrics.in_flight.inc()
                    started = time.time()
                    try:
                        reply = await runner.executor.execute(
                            model,
                            request.url,
                            body,
                            request_id,
                            exclude=exclude,
                            hints=hints,
                            tenant=tenant,
                        )
                    finally:
                        runner.metrics.in_flight.dec()
                    result = result_of(number, request.custom_id, request_id, reply)
                    if runner.usage is not None and reply.replica_id:
                        # Before the result is stored: a crash in between runs the line
                        # again, and the engines did that work twice.
                        runner.usage.write(self._usage(started, model, reply, result))
                except NoReplica:
                    if exclude:  # only replicas that failed it are left: try them again
                        exclude = []
                    else:
                        await self._unless_stopped(
                            lambda: asyncio.sleep(
                                min(NO_REPLICA_WAIT_MAX_S, runner.config.retry_backoff_s)
                            )
                        )
                except ReplicaFailed as err:
                    attempts += 1
                    if attempts >= runner.config.max_attempts:
                        result = Result(
                            line=number,
                            custom_id=request.custom_id,
                            status_code=0,
                            request_id=request_id,
                            error_code="replica_failed",
                            error_message=f"failed {attempts} times; last: {err}",
                        )
                        break
                    runner.metrics.retries.inc()
                    log.info(
                        "batch %s line %d: attempt %d failed (%s); retrying",
                        self.record.id,
                        number,
                        attempts,
                        err,
                    )
                    exclude = [err.replica_id] if err.replica_id else []
                    delay = runner.config.retry_backoff_s * 2 ** (attempts - 1)
                    await self._unless_stopped(functools.partial(asyncio.sleep, delay))
            runner.batch_tokens.charge(
                self.record.tenant, result.input_tokens + result.output_tokens
            )
            # The slot is held until the result is stored: answered-but-unstored work (what a
            # crash makes an engine redo) stays within the concurrency bound.
            await runner.committer.record(self.record.id, result, model)
        except _Stop:
            pass  # never answered: reported as cancelled/expired when the batch ends
        except Exception:
            # Not stored: the line runs again when the batch is picked up again.
            log.exception("batch %s line %d: request failed unexpectedly", self.record.id, number)
        finally:
            slots.release()

    async def _finish(self) -> None:
        store = self.runner.store
        current = await asyncio.to_thread(store.get_batch, self.record.id)
        if current.status == "cancelling" or self.reason == "cancelled":
            status, code, message = (
                "cancelled",
                "batch_cancelled",
                "The batch was cancelled before this request ran.",
            )
        elif self.reason == "expired":
            status, code, message = (
                "expired",
                "batch_expired",
                "This request could not be executed before the completion window expired.",
            )
        else:
            status, code, message = "completed", None, ""
            if current.completed + current.failed < current.total:
                # Some results were not stored (a failed commit): run those lines again.
                log.warning(
                    "batch %s: %d of %d results stored; running the rest again",
                    current.id,
                    current.completed + current.failed,
                    current.total,
                )
                await asyncio.sleep(POLL_S)
                return
            if current.status != "finalizing":
                current = await asyncio.to_thread(
                    store.update_batch,
                    current.id,
                    status="finalizing",
                    finalizing_at=int(time.time()),
                )
        final = await asyncio.to_thread(
            store.finish, current, status=status, unfinished_code=code, unfinished_message=message
        )
        self.record = final
        log.info(
            "batch %s: %s (%d completed, %d failed of %d)",
            final.id,
            status,
            final.completed,
            final.failed,
            final.total,
        )


class _Line(msgspec.Struct, frozen=True):
    request: RequestLine
    model: str


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        executor: Executor,
        config: BatchConfig,
        *,
        tenants: dict[str, TenantConfig],
        metrics: BatchMetrics,
        model_loads: Callable[[], Awaitable[dict[str, ModelLoad]]] | None = None,
        quota: QuotaGate | None = None,
        lock: RunnerLock | None = None,
        usage: UsageLog | None = None,
    ) -> None:
        """usage: where each answered line's usage record goes (contracts/usage.py)."""
        self.store = store
        self.usage = usage
        self.lock = lock or RunnerLock(store.root, "gateway", name="gateway")
        self.executor = executor
        self.config = config
        self.tenants = tenants
        self.metrics = metrics
        self.slots = PoolSlots(
            config.concurrency_per_replica,
            adaptive=config.adaptive_concurrency,
            maximum=config.max_concurrency_per_replica,
        )
        self.committer = Committer(store, metrics)
        self._model_loads = model_loads
        self._adapted_at = -ADAPT_S
        self.batch_tokens = BatchTokens(
            quota or QuotaGate("batch-runner"),
            {name: t.batch_tokens_per_min for name, t in tenants.items()},
        )
        self._jobs: dict[str, tuple[BatchJob, asyncio.Task[None]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watched_at = -WATCH_S
        self._watch_state: tuple[bool, str | None] | None = None
        self._unrun_seen = 0

    def check_input(self, record: BatchRecord) -> list[BatchError]:
        """Why a validating batch cannot run (empty: it can)."""
        try:
            file = self.store.get_file(record.input_file_id, None)
        except LookupError:
            return [BatchError("missing_file", f"Input file {record.input_file_id} is gone")]
        problems: list[BatchError] = []
        tenant = self.tenants.get(record.tenant) or TenantConfig(name=record.tenant)
        allowed = tenant.allowed_models
        summary = file.summary
        if summary is None:
            return [BatchError("invalid_file", f"File {file.id} is not a batch input file")]
        if summary.urls == [record.endpoint] and (
            not allowed or all(m in allowed for m in summary.models)
        ):
            return []
        for number, raw in self.store.input_lines(file.id):
            line = request_line_decoder.decode(raw)
            model = _model.decode(line.body).model
            if line.url != record.endpoint:
                problems.append(
                    BatchError(
                        "invalid_url",
                        f"The url {line.url!r} does not match the batch's endpoint "
                        f"{record.endpoint!r}",
                        line=number,
                        param="url",
                    )
                )
            elif allowed and model not in allowed:
                problems.append(
                    BatchError(
                        "model_not_allowed",
                        f"Tenant '{record.tenant}' may not use model {model!r}",
                        line=number,
                        param="body.model",
                    )
                )
            if len(problems) == 20:
                break
        return problems

    def notify(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        job = self._jobs.get(batch_id)
        if job is not None:
            job[0].stop("cancelled")
        self._wake.set()

    def job(self, batch_id: str) -> BatchJob | None:
        entry = self._jobs.get(batch_id)
        return entry[0] if entry else None

    async def start(self) -> None:
        self.committer.start()
        self._task = asyncio.create_task(self._supervise(), name="batch-runner")

    async def close(self) -> None:
        for job, _ in self._jobs.values():
            job.abort()
        tasks = [t for _, t in self._jobs.values()]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.committer.close()
        if self.lock.held:
            log.info("batch runner: released %s (stopping)", self.lock.path)
        self.lock.close()
        self.metrics.lock_held.set(0)

    async def _supervise(self) -> None:
        while True:
            try:
                await self._pass()
            except Exception:
                log.exception("batch runner: supervision pass failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()
            self._wake.clear()

    async def _pass(self) -> None:
        lock = self.lock
        if await asyncio.to_thread(lock.should_hand_back):
            await self._hand_back()
        held = lock.held
        if not await asyncio.to_thread(lock.try_take):
            await self._watch()
            return
        if not held:
            log.info(
                "batch runner: holding %s, running batches (as %s)",
                self.lock.path,
                lock.identity,
            )
            self.metrics.lock_held.set(1)
            self.metrics.unrun.set(0)
            self._watch_state, self._unrun_seen = None, 0
        await self._refresh_replicas()
        for record in await asyncio.to_thread(self.store.active_batches):
            if record.id not in self._jobs:
                self._launch(record)
            elif record.status == "cancelling":
                self._jobs[record.id][0].stop("cancelled")
        self.metrics.active.set(len(self._jobs))

    async def _hand_back(self) -> None:
        """A runner process is up: stop taking lines, let what is in flight be stored, let go."""
        jobs = list(self._jobs.values())
        log.info(
            "batch runner: a batch-runner process is up; handing %d batch(es) over once "
            "their %d request(s) in flight are stored",
            len(jobs),
            self.slots.in_flight(),
        )
        for job, _ in jobs:
            job.stop(HANDOVER)
        tasks = [task for _, task in jobs]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=HANDOVER_WAIT_S)
            for job, task in jobs:
                if task in late:
                    job.abort()  # not stored: the runner process runs those lines again
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.lock.release()
        self.metrics.lock_held.set(0)
        self.metrics.active.set(len(self._jobs))
        log.info("batch runner: released %s to the batch-runner process", self.lock.path)

    async def _watch(self) -> None:
        """Not holding the lock: every WATCH_S, see that someone runs the active batches and
        log when that changes (twice in a row with nobody: a runner may just be starting)."""
        now = time.monotonic()
        if now - self._watched_at < WATCH_S:
            return
        self._watched_at = now
        active = len(await asyncio.to_thread(self.store.active_batches))
        holder = await asyncio.to_thread(self.lock.holder) if active else None
        self._unrun_seen = self._unrun_seen + 1 if active and holder is None else 0
        unrun = self._unrun_seen >= 2
        self.metrics.unrun.set(active if unrun else 0)
        state = (unrun, holder)
        if state == self._watch_state or (active and holder is None and not unrun):
            return
        self._watch_state = state
        if unrun:
            log.warning(
                "batch runner: %d batch(es) waiting and no process holds %s (%s)",
                active,
                self.lock.path,
                "batch.runner = 'process': start `hpcserve batch-runner`"
                if self.lock.role == "never"
                else "this process takes it when it may",
            )
        elif holder is not None:
            log.info("batch runner: batches run by %s", holder)

    async def _refresh_replicas(self) -> None:
        if self._model_loads is None:
            return
        try:
            loads = await self._model_loads()
        except Exception as err:
            log.debug("replica loads unavailable: %s", err)
            return
        now = time.monotonic()
        adapt = now - self._adapted_at >= ADAPT_S  # the engines' heartbeat: fresher is noise
        if adapt:
            self._adapted_at = now
        self.slots.set_loads(loads, adapt=adapt)
        for model, limit in self.slots.limits().items():
            self.metrics.limit.labels(model).set(limit)

    def _launch(self, record: BatchRecord) -> None:
        job = BatchJob(self, record)
        task = asyncio.create_task(job.run(), name=f"batch-{record.id}")
        self._jobs[record.id] = (job, task)

        def ended(task: asyncio.Task[None]) -> None:
            self._jobs.pop(record.id, None)
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "batch %s: runner failed, retried at the next pass: %r",
                    record.id,
                    task.exception(),
                )
            else:
                self._wake.set()

        task.add_done_callback(ended)
