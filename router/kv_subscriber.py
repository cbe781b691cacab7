"""Subscribes to every replica's vLLM KV-cache events and keeps the PrefixIndex current.

One SUB socket connects to all publishers; each replica publishes on its own topic (its
replica id), which tells the messages apart. The router's loop polls the socket (and any
replay DEALERs) beside its own, so the index is only touched from that one thread.

Per replica: the next expected sequence number. The first message and every gap trigger a
replay request (kv_wire's protocol) from the first missing number; live messages wait in
a queue until the replay ends, then the ones not replayed are applied in order. When the
replay cannot cover the gap (no replay socket, the batches left its buffer, or no answer
within `replay_timeout_s`) the replica's index is cleared: it counts as cold (fail open)
and fills again from new events.

Silence: an idle engine publishes nothing, so silence alone proves nothing; but a replica
that was sent a prompt of at least one full block and published nothing for `silence_s`
has lost its publisher (or us), and is cleared too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from hpcserve.contracts import kv_wire as kw
from hpcserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

Buffer = bytes | zmq.Frame  # a payload: bytes from the replay socket, a Frame from the live one

_NOBLOCK = int(zmq.NOBLOCK)


class IngestCounts(Collector):
    """Batches applied, blocks stored and blocks removed: plain ints added to per message
    (a prometheus Counter.inc takes a lock, ~1 us, three times per message) and read at
    scrape time."""

    def __init__(self) -> None:
        self.batches = 0
        self.blocks = 0
        self.removed = 0

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "hpcserve_router_kv_batches", "KV event batches applied", value=self.batches
        )
        yield CounterMetricFamily(
            "hpcserve_router_kv_blocks_stored", "Blocks stored by events", value=self.blocks
        )
        yield CounterMetricFamily(
            "hpcserve_router_kv_blocks_removed",
            "Blocks removed by events (the engine evicted them)",
            value=self.removed,
        )


class SubscriberMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ingest = IngestCounts()
        registry.register(self.ingest)
        self.gaps = Counter(
            "hpcserve_router_kv_gaps_total", "Sequence gaps seen (replay asked)", registry=registry
        )
        self.resets = Counter(
            "hpcserve_router_kv_resets_total",
            "Replica indexes cleared (fail open) by reason",
            ["reason"],
            registry=registry,
        )
        self.bad = Counter(
            "hpcserve_router_kv_bad_messages_total",
            "Undecodable KV event messages",
            registry=registry,
        )


@dataclass
class _Stream:
    replica_id: str
    endpoint: str
    replay_endpoint: str
    next_seq: int | None = None  # None: nothing seen yet
    replay: zmq.Socket | None = None
    replay_deadline: float = 0.0
    queued: list[tuple[int, Buffer]] = field(default_factory=list)
    prompt_sent_at: float | None = None  # first full-block prompt routed since the last event


class KvEventSubscriber:
    def __init__(
        self,
        index: PrefixIndex,
        *,
        clock: Callable[[], float],
        silence_s: float = 30.0,
        replay_timeout_s: float = 2.0,
        context: zmq.Context | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.index = index
        self.silence_s = silence_s
        self.replay_timeout_s = replay_timeout_s
        self._clock = clock
        self._ctx = context or zmq.Context.instance()
        self.metrics = SubscriberMetrics(metrics_registry or CollectorRegistry())
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._streams: dict[bytes, _Stream] = {}
        self._by_replica: dict[str, bytes] = {}
        self._replays: dict[zmq.Socket, _Stream] = {}

    # --- membership -----------------------------------------------------------------
    def watching(self, replica_id: str) -> bool:
        return replica_id in self._by_replica

    def watch(self, replica_id: str, endpoint: str, replay_endpoint: str, topic: str) -> None:
        topic_b = topic.encode()
        old = self._streams.get(topic_b)
        if old is not None and (old.endpoint, old.replica_id) == (endpoint, replica_id):
            return
        self.unwatch(replica_id)
        if topic_b in self._streams:
            other = self._streams[topic_b].replica_id
            # One SUB socket: streams are told apart by topic only.
            log.warning(
                "KV events topic %r of %s was %s's: following %s",
                topic,
                replica_id,
                other,
                replica_id,
            )
            self.unwatch(other)
        self.sub.connect(endpoint)
        stream = _Stream(replica_id, endpoint, replay_endpoint)
        self._streams[topic_b] = stream
        self._by_replica[replica_id] = topic_b
        self.index.slot(replica_id)
        log.info("subscribed to KV events of %s at %s", replica_id, endpoint)

    def unwatch(self, replica_id: str) -> None:
        topic_b = self._by_replica.pop(replica_id, None)
        if topic_b is None:
            return
        stream = self._streams.pop(topic_b)
        with contextlib.suppress(zmq.ZMQError):
            self.sub.disconnect(stream.endpoint)
        self._close_replay(stream)
        self.index.drop(replica_id)

    def close(self) -> None:
        for replica_id in list(self._by_replica):
            self.unwatch(replica_id)
        self.sub.close(0)

    def replay_sockets(self) -> list[zmq.Socket]:
        return list(self._replays)

    # --- messages -------------------------------------------------------------------
    def drain(self, limit: int = 10_000) -> int:
        """Handle queued event messages without blocking; returns how many."""
        handled = 0
        recv, streams = self.sub.recv, self._streams
        while handled < limit:
            try:
                topic = recv(_NOBLOCK)
            except zmq.Again:
                break
            handled += 1
            # vLLM sends [topic, seq, payload]. The payload comes as a zmq.Frame (no copy into
            # bytes), whose `more` tells whether the message went on: a getsockopt(RCVMORE)
            # costs as much as a recv, and this loop is the ingest rate. A message of another
            # shape is counted bad and may take the next queued one along; that one's stream
            # sees a seq gap and heals as from any message PUB/SUB drops (replay, or reset).
            try:
                seq_frame = recv(_NOBLOCK)
                payload = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                self.metrics.bad.inc()
                break
            if payload.more:
                self.metrics.bad.inc()
                while recv(_NOBLOCK, copy=False).more:
                    pass
                continue
            stream = streams.get(topic)
            if stream is None:
                continue
            if len(seq_frame) != 8:
                self.metrics.bad.inc()
                continue
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == stream.next_seq and stream.replay is None:
                self._apply(stream, seq, payload)  # in order, the common case
            else:
                self._on_live(stream, seq, payload)
        return handled

    def _on_live(self, stream: _Stream, seq: int, payload: Buffer) -> None:
        if stream.replay is not None:
            stream.queued.append((seq, payload))
            return
        if stream.next_seq is not None and seq < stream.next_seq:
            return  # already applied
        if stream.next_seq != seq:
            start = 0 if stream.next_seq is None else stream.next_seq
            if stream.next_seq is not None:
                self.metrics.gaps.inc()
            if self._ask_replay(stream, start):
                stream.queued.append((seq, payload))
                return
            if stream.next_seq is not None:
                self._reset(stream, "gap without replay")
        self._apply(stream, seq, payload)

    def _apply(self, stream: _Stream, seq: int, payload: Buffer) -> None:
        stream.next_seq = seq + 1
        try:
            batch = kw.decode_batch_raw_tokens(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.metrics.bad.inc()
            return
        try:
            stored, removed = self.index.apply(stream.replica_id, batch.events)
        except ValueError as exc:
            # token_ids that are not an array of token ids: the events before it in the
            # batch stay applied; the rest, and later blocks chained on it, look cold.
            self.metrics.bad.inc()
            log.debug("KV events of %s: bad BlockStored (%s)", stream.replica_id, exc)
            return
        counts = self.metrics.ingest
        counts.blocks += stored
        counts.removed += removed
        counts.batches += 1
        stream.prompt_sent_at = None

    def _reset(self, stream: _Stream, reason: str) -> None:
        self.index.clear(stream.replica_id)
        self.metrics.resets.labels(reason).inc()
        log.warning("KV index of %s cleared (%s): cold until new events", stream.replica_id, reason)

    # --- replay ---------------------------------------------------------------------
    def _ask_replay(self, stream: _Stream, start: int) -> bool:
        if not stream.replay_endpoint:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(stream.replay_endpoint)
        sock.send_multipart(kw.replay_request(start))
        stream.replay = sock
        stream.replay_deadline = self._clock() + self.replay_timeout_s
        self._replays[sock] = stream
        return True

    def on_replay(self, sock: zmq.Socket) -> None:
        stream = self._replays.get(sock)
        if stream is None:
            return
        while stream.replay is sock:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 4:
                self.metrics.bad.inc()
                continue
            try:
                seq = kw.decode_seq(frames[2])
            except ValueError:
                self.metrics.bad.inc()
                continue
            if seq < 0:
                self._finish_replay(stream)
                return
            expected = stream.next_seq
            if expected is not None and seq < expected:
                continue
            if expected is not None and seq > expected:
                # The publisher's buffer no longer holds what we missed.
                self._reset(stream, "replay too short")
            self._apply(stream, seq, frames[3])

    def _finish_replay(self, stream: _Stream) -> None:
        self._close_replay(stream)
        queued, stream.queued = stream.queued, []
        for seq, payload in sorted(queued, key=lambda item: item[0]):
            if stream.next_seq is not None and seq < stream.next_seq:
                continue
            if stream.next_seq is not None and seq > stream.next_seq:
                self._reset(stream, "gap after replay")
            self._apply(stream, seq, payload)

    def _close_replay(self, stream: _Stream) -> None:
        if stream.replay is not None:
            self._replays.pop(stream.replay, None)
            stream.replay.close(0)
            stream.replay = None

    # --- time -----------------------------------------------------------------------
    def prompt_sent(self, replica_id: str) -> None:
        """A prompt of at least one full block was routed to the replica."""
        topic_b = self._by_replica.get(replica_id)
        if topic_b is not None:
            stream = self._streams[topic_b]
            if stream.prompt_sent_at is None:
                stream.prompt_sent_at = self._clock()

    def tick(self) -> None:
        now = self._clock()
        for stream in self._streams.values():
            if stream.replay is not None and now > stream.replay_deadline:
                log.warning("KV replay from %s unanswered", stream.replay_endpoint)
                self._close_replay(stream)
                queued, stream.queued = stream.queued, []
                if stream.next_seq is not None:
                    self._reset(stream, "replay timeout")
                for seq, payload in sorted(queued, key=lambda item: item[0]):
                    self._apply(stream, seq, payload)
            if stream.prompt_sent_at is not None and now - stream.prompt_sent_at > self.silence_s:
                stream.prompt_sent_at = None
                self._reset(stream, "silent")
