"""The engine agent's KV-event relay: vLLM's publisher, reachable by the service account
only, to the router over CURVE.

vLLM publishes the token ids of every prompt it caches (KV-cache events). Its publisher and
replay socket bind `ipc://` paths in a directory of mode 0700 (`kv_events_dir`), so no other
user on the node can connect to them (loopback TCP would not do: another user's job on the
same node reaches 127.0.0.1 too). This relay, a thread of the engine process (the service
account), subscribes there and forwards each message to the router's KV relay socket, a
CURVE server that admits the cluster's engine key (contracts/curve.py), like registration.

Frames pass through untouched: vLLM's `[topic, seq, payload]` (the router's ingest decodes
the payload straight from the frame, contracts/_blockhash.c), nothing decoded here. The
relay's DEALER carries the replica's topic as its routing id, so the router knows which
connection a stream came by and where to send a replay request. A replay request from the
router (vLLM's own `[b"", start_seq]`) goes to vLLM's replay socket unchanged, and each
answer (`[b"", topic, seq, payload]`, then the end marker) back to the router on the same
connection, in order with the live messages. Sequence numbers, gap detection and the
decision to replay stay the router's (router/kv_subscriber.py): a message this relay drops
(the router unreachable past the send queue) is a gap there, healed by a replay.

The router's address comes with its registration answer (RegistryAck.kv_relay): the relay
connects once it is known, and again if it changes (the router moved). Until then vLLM's
messages are read and dropped (nothing piles up on the node); the router's first message
of the stream asks for a replay from 0.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import zmq

from hpcserve.contracts.curve import make_client

log = logging.getLogger(__name__)

# Messages queued towards the router before new ones are dropped (a gap the router heals
# by a replay): vLLM keeps 10,000 batches for replay by default.
SEND_HWM = 10_000
_REPLAY_REQUEST_FRAMES = 2


class RelayCounts:
    """Plain ints, read by the engine's log lines and the benchmark."""

    __slots__ = ("bad_requests", "dropped", "forwarded", "replay_frames", "replays")

    def __init__(self) -> None:
        self.forwarded = 0
        self.dropped = 0
        self.replays = 0
        self.replay_frames = 0
        self.bad_requests = 0


class KvEventRelay:
    """`start()` the thread; `connect_router(endpoint)` (any thread) once the router's relay
    address is known; `stop()`. One thread owns every socket."""

    def __init__(
        self,
        events_endpoint: str,
        replay_endpoint: str,
        topic: str,
        *,
        curve_dir: str = "",
        context: zmq.Context | None = None,
        poll_ms: int = 100,
    ) -> None:
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.curve_dir = curve_dir
        self.counts = RelayCounts()
        self._ctx = context or zmq.Context.instance()
        self._poll_ms = poll_ms
        self._router = ""  # the endpoint wanted (set by connect_router)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.connected_to = ""  # the endpoint the thread's DEALER dials now

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)
        self._thread.start()

    def connect_router(self, endpoint: str) -> None:
        self._router = endpoint

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # --- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.events_endpoint)
        replay = self._ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        if self.replay_endpoint:
            replay.connect(self.replay_endpoint)
        up: zmq.Socket | None = None
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if self._router != self.connected_to:
                    if up is not None:
                        poller.unregister(up)
                        up.close(0)
                    up = self._connect_up(self._router)
                    poller.register(up, zmq.POLLIN)
                events = dict(poller.poll(self._poll_ms))
                if up is None:
                    # No router known yet (or one that takes no events): nothing is kept.
                    # The router's first message of the stream asks for a replay from 0,
                    # which vLLM's buffer answers.
                    if sub in events:
                        self._discard(sub)
                    continue
                if sub in events:
                    self._forward(sub, up)
                if replay in events:
                    self._forward_replay(replay, up)
                if up in events:
                    self._on_request(up, replay)
        except zmq.ZMQError as err:
            if not self._stop.is_set():
                log.error("KV event relay stopped: %s", err)
        finally:
            sub.close(0)
            replay.close(0)
            if up is not None:
                up.close(0)
            counts = self.counts
            log.info(
                "KV event relay of %s stopped: %d messages forwarded, %d dropped, %d replays",
                self.topic.decode(),
                counts.forwarded,
                counts.dropped,
                counts.replays,
            )

    def _connect_up(self, endpoint: str) -> zmq.Socket:
        up = self._ctx.socket(zmq.DEALER)
        up.setsockopt(zmq.LINGER, 0)
        up.setsockopt(zmq.ROUTING_ID, self.topic)
        up.setsockopt(zmq.SNDHWM, SEND_HWM)
        if self.curve_dir:  # the cluster's engine key, as for registration
            make_client(up, Path(self.curve_dir))
        up.connect(endpoint)
        self.connected_to = endpoint
        log.info("relaying KV events of %s to the router at %s", self.topic.decode(), endpoint)
        return up

    def _forward(self, sub: zmq.Socket, up: zmq.Socket) -> None:
        counts = self.counts
        for _ in range(10_000):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                up.send_multipart(frames, zmq.NOBLOCK, copy=False)
                counts.forwarded += 1
            except zmq.Again:
                counts.dropped += 1  # the router sees a gap and asks for a replay

    def _discard(self, sub: zmq.Socket) -> None:
        for _ in range(10_000):
            try:
                sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.counts.dropped += 1

    def _forward_replay(self, replay: zmq.Socket, up: zmq.Socket) -> None:
        for _ in range(10_000):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                up.send_multipart(frames, zmq.NOBLOCK, copy=False)
                self.counts.replay_frames += 1
            except zmq.Again:
                self.counts.dropped += 1  # the router's replay times out and resets

    def _on_request(self, up: zmq.Socket, replay: zmq.Socket) -> None:
        while True:
            try:
                frames = up.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # vLLM's replay request, [b"", start_seq]: passed on as it is, nothing else.
            if len(frames) != _REPLAY_REQUEST_FRAMES or frames[0] or len(frames[1]) != 8:
                self.counts.bad_requests += 1
                log.warning("KV event relay: a malformed replay request dropped")
                continue
            if not self.replay_endpoint:
                continue  # the router's replay times out: it clears the replica's index
            try:
                replay.send_multipart(frames, zmq.NOBLOCK)
                self.counts.replays += 1
            except zmq.Again:
                self.counts.dropped += 1  # vLLM's replay socket is not there (yet)
