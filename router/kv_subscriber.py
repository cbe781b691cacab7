"""Takes every replica's vLLM KV-cache events and keeps the PrefixIndex current.

Engines' events come relayed (engine_launch/kv_relay.py): vLLM publishes on an `ipc://`
socket only the service account can reach, and the engine agent forwards vLLM's frames,
untouched, to the router's KV relay socket, a ROUTER this subscriber binds (`bind_relay`),
CURVE with the cluster's engine key when the router has keys (contracts/curve.py). Each
agent's DEALER carries its replica's topic as routing id; a message whose topic is not its
connection's is refused. Replay requests go back to the agent on the same connection, which
passes them to vLLM's replay socket and its answers back, in order with live messages.
Publishers registered with an endpoint of their own (the simulated fleet, sim/fleet.py) are
subscribed to directly: one SUB socket connects to all of them, and a replay DEALER per gap.
Each replica publishes on its own topic (its replica id), which tells the messages apart.
The router's loop polls these sockets beside its own, so the index is only touched from
that one thread.

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
from pathlib import Path
from typing import cast

import msgspec
import zmq
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.curve import make_server
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
    endpoint: str  # "" for a relayed stream
    replay_endpoint: str
    relayed: bool = False
    next_seq: int | None = None  # None: nothing seen yet
    replaying: bool = False
    replay: zmq.Socket | None = None  # a direct stream's replay DEALER while replaying
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
        # The relay socket engines' agents connect to (bind_relay); None until bound.
        self.relay: zmq.Socket | None = None
        self.relay_endpoint = ""

    def bind_relay(self, endpoint: str, curve_dir: str = "") -> str:
        """Bind the KV relay socket (CURVE server with the router's key when curve_dir is
        given; the ZAP authenticator admits the engine keys); returns the bound endpoint
        (a `*` port resolved). RuntimeError names the endpoint when it cannot bind."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # A restarted agent (same replica id) takes its stream over at once.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if curve_dir:
            make_server(sock, Path(curve_dir))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as err:
            sock.close(0)
            raise RuntimeError(
                f"router cannot bind the KV relay socket {endpoint} (router.kv_relay_bind): {err}"
            ) from None
        self.relay = sock
        self.relay_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.relay_endpoint

    # --- membership -----------------------------------------------------------------
    def watching(self, replica_id: str) -> bool:
        return replica_id in self._by_replica

    def watch(
        self,
        replica_id: str,
        endpoint: str,
        replay_endpoint: str,
        topic: str,
        *,
        relayed: bool = False,
    ) -> None:
        """Follow a replica's events: relayed (its agent connects to the relay socket), or
        from its own publisher at `endpoint`."""
        topic_b = topic.encode()
        if relayed:
            endpoint = replay_endpoint = ""
        old = self._streams.get(topic_b)
        if old is not None and (old.endpoint, old.replica_id, old.relayed) == (
            endpoint,
            replica_id,
            relayed,
        ):
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
        if not relayed:
            self.sub.connect(endpoint)
        stream = _Stream(replica_id, endpoint, replay_endpoint, relayed)
        self._streams[topic_b] = stream
        self._by_replica[replica_id] = topic_b
        self.index.slot(replica_id)
        if relayed:
            log.info("following KV events of %s relayed by its engine agent", replica_id)
        else:
            log.info("subscribed to KV events of %s at %s", replica_id, endpoint)

    def unwatch(self, replica_id: str) -> None:
        topic_b = self._by_replica.pop(replica_id, None)
        if topic_b is None:
            return
        stream = self._streams.pop(topic_b)
        if not stream.relayed:
            with contextlib.suppress(zmq.ZMQError):
                self.sub.disconnect(stream.endpoint)
        self._close_replay(stream)
        self.index.drop(replica_id)

    def close(self) -> None:
        for replica_id in list(self._by_replica):
            self.unwatch(replica_id)
        self.sub.close(0)
        if self.relay is not None:
            self.relay.close(0)
            self.relay = None

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
            if stream is None or stream.relayed:
                continue
            if len(seq_frame) != 8:
                self.metrics.bad.inc()
                continue
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == stream.next_seq and not stream.replaying:
                self._apply(stream, seq, payload)  # in order, the common case
            else:
                self._on_live(stream, seq, payload)
        return handled

    def drain_relay(self, limit: int = 10_000) -> int:
        """Handle queued relayed messages without blocking; returns how many.

        The agents' frames as vLLM sent them, behind the connection's routing id: a live
        message `[topic, seq, payload]` (the same fast path as `drain`), or a replay answer
        `[b"", topic, seq, payload]` (`[b"", b"", -1, b""]` ends a replay)."""
        relay = self.relay
        if relay is None:
            return 0
        handled = 0
        recv, streams = relay.recv, self._streams
        while handled < limit:
            try:
                peer = recv(_NOBLOCK)
            except zmq.Again:
                break
            handled += 1
            try:
                topic = recv(_NOBLOCK)
                if not topic:  # a replay answer (rare: the RCVMORE check is affordable)
                    if relay.rcvmore:
                        self._on_relayed_replay(peer, relay.recv_multipart(_NOBLOCK))
                    else:
                        self.metrics.bad.inc()
                    continue
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
            if stream is None or not stream.relayed:
                continue
            if peer != topic or len(seq_frame) != 8:
                # Another replica's topic: an agent speaks for its own replica only.
                self.metrics.bad.inc()
                continue
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == stream.next_seq and not stream.replaying:
                self._apply(stream, seq, payload)
            else:
                self._on_live(stream, seq, payload)
        return handled

    def _on_live(self, stream: _Stream, seq: int, payload: Buffer) -> None:
        if stream.replaying:
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
            # A zmq.Frame is a buffer msgspec decodes in place (no copy into bytes).
            batch = kw.decode_batch_raw_tokens(cast(bytes, payload))
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
        if stream.relayed:
            if self.relay is None:
                return False
            try:
                # To the agent whose connection carries the stream (routing id = topic);
                # one that is gone drops it, and the replay times out.
                self.relay.send_multipart(
                    [self._by_replica[stream.replica_id], *kw.replay_request(start)], _NOBLOCK
                )
            except zmq.ZMQError:
                return False
        else:
            if not stream.replay_endpoint:
                return False
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(stream.replay_endpoint)
            sock.send_multipart(kw.replay_request(start))
            stream.replay = sock
            self._replays[sock] = stream
        stream.replaying = True
        stream.replay_deadline = self._clock() + self.replay_timeout_s
        return True

    def on_replay(self, sock: zmq.Socket) -> None:
        """Answers on a direct stream's replay DEALER."""
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
            self._on_replayed(stream, frames[2], frames[3])

    def _on_relayed_replay(self, peer: bytes, frames: list[bytes]) -> None:
        """A replay answer an agent relayed: [topic, seq, payload] after the empty frame."""
        stream = self._streams.get(peer)
        if stream is None or not stream.relayed or not stream.replaying:
            return  # late (the replay timed out) or not ours
        if len(frames) != 3 or (frames[0] and frames[0] != peer):
            self.metrics.bad.inc()
            return
        self._on_replayed(stream, frames[1], frames[2])

    def _on_replayed(self, stream: _Stream, seq_frame: bytes, payload: bytes) -> None:
        try:
            seq = kw.decode_seq(seq_frame)
        except ValueError:
            self.metrics.bad.inc()
            return
        if seq < 0:
            self._finish_replay(stream)
            return
        expected = stream.next_seq
        if expected is not None and seq < expected:
            return
        if expected is not None and seq > expected:
            # The publisher's buffer no longer holds what we missed.
            self._reset(stream, "replay too short")
        self._apply(stream, seq, payload)

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
        stream.replaying = False
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
            if stream.replaying and now > stream.replay_deadline:
                log.warning(
                    "KV replay for %s unanswered (%s)",
                    stream.replica_id,
                    "its engine agent" if stream.relayed else stream.replay_endpoint,
                )
                self._close_replay(stream)
                queued, stream.queued = stream.queued, []
                if stream.next_seq is not None:
                    self._reset(stream, "replay timeout")
                for seq, payload in sorted(queued, key=lambda item: item[0]):
                    self._apply(stream, seq, payload)
            if stream.prompt_sent_at is not None and now - stream.prompt_sent_at > self.silence_s:
                stream.prompt_sent_at = None
                self._reset(stream, "silent")
