"""vLLM's KV-cache event wire, as vLLM 0.32 publishes it (vllm/distributed/kv_events.py).

This is vLLM's protocol, not ours (ours is contracts/protocol.py). Nothing here imports vLLM.

Wire: a ZeroMQ PUB socket sends one three-frame message per batch,
``[topic, seq, payload]``: ``seq`` is 8 bytes big-endian, counting from 0 per publisher;
``payload`` is msgpack of ``KVEventBatch`` = ``[ts, [event, ...], data_parallel_rank]``.
Each event is a map tagged by ``"type"`` (``{"type": "BlockStored", "block_hashes": ...}``);
releases before the map layout sent each event as a positional array
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, ...]``).
``decode_batch`` reads both and returns the same Struct classes either way.

Replay: the publisher binds a ROUTER socket. A subscriber's DEALER sends
``[b"", start_seq]`` (``start_seq`` 8 bytes big-endian) and receives
``[b"", topic, seq, payload]`` for every buffered batch with seq >= start_seq, then
``[b"", b"", END_SEQ, b""]`` (seq -1).

Publishing (e.g. the simulated engine)::

    from hpcserve.contracts import kv_wire as kw
    pub = kw.KVEventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558")
    pub.publish([kw.BlockStored(block_hashes=[h1, h2], parent_block_hash=None,
                                token_ids=tokens_of_both_blocks, block_size=16)])
    pub.publish([kw.BlockRemoved(block_hashes=[h1])])
    pub.service_replay()   # call often (publish() also does): answers replay requests
    pub.close()

or, with your own sockets: ``sock.send_multipart(kw.encode_frames(topic, seq, batch))``.

Decoding::

    topic, seq_bytes, payload = sub.recv_multipart()
    seq = kw.decode_seq(seq_bytes)
    batch = kw.decode_batch(payload)       # raises msgspec.DecodeError on garbage
    for event in batch.events:             # BlockStored | BlockRemoved | AllBlocksCleared
        ...

The router's index decodes with ``decode_batch_raw_tokens`` instead: the same events, but
each BlockStored's ``token_ids`` is the ``msgspec.Raw`` msgpack of the array, which
prefix_hash.chain_hashes_msgpack hashes without making a Python int per token.

Block hashes are ``bytes`` (sha256, vLLM's default) or ``int`` (with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); treat them as opaque ids.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgspec
import zmq

BlockHash = bytes | int

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# Named-map layout (vLLM 0.32). Every field after the first has a default, so a map
# from a release with fewer fields still decodes; encoding writes every field.
class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# Positional layout (earlier releases): the same classes, array_like. Subclasses, so
# isinstance(event, BlockStored) holds for both layouts.
class _BlockStoredPositional(BlockStored, array_like=True):
    pass


class _BlockRemovedPositional(BlockRemoved, array_like=True):
    pass


class _AllBlocksClearedPositional(AllBlocksCleared, array_like=True):
    pass


class _PositionalBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BlockStoredPositional | _BlockRemovedPositional | _AllBlocksClearedPositional]
    data_parallel_rank: int | None = None


# The router's ingest: `token_ids` left as the raw msgpack bytes of the array
# (prefix_hash.chain_hashes_msgpack hashes them in C), so no Python int is made per token.
class _BlockStoredRawTokens(BlockStored, tag="BlockStored"):
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # type: ignore[assignment]


class _BlockStoredRawTokensPositional(_BlockStoredRawTokens, array_like=True):
    pass


class _RawTokensBatch(KVEventBatch):
    events: list[_BlockStoredRawTokens | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


class _RawTokensPositionalBatch(_PositionalBatch):
    events: list[  # type: ignore[assignment]
        _BlockStoredRawTokensPositional | _BlockRemovedPositional | _AllBlocksClearedPositional
    ]


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_positional_decoder = msgspec.msgpack.Decoder(_PositionalBatch)
_raw_map_decoder = msgspec.msgpack.Decoder(_RawTokensBatch)
_raw_positional_decoder = msgspec.msgpack.Decoder(_RawTokensPositionalBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def encode_positional_batch(batch: KVEventBatch) -> bytes:
    """The batch in the earlier positional-array layout (for tests and old consumers)."""
    positional = {
        BlockStored: _BlockStoredPositional,
        BlockRemoved: _BlockRemovedPositional,
        AllBlocksCleared: _AllBlocksClearedPositional,
    }
    events: list[Any] = [
        positional[type(e)](**{f: getattr(e, f) for f in e.__struct_fields__})
        if type(e) in positional
        else e
        for e in batch.events
    ]
    return _encoder.encode(_PositionalBatch(batch.ts, events, batch.data_parallel_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode either layout; msgspec.DecodeError (or ValidationError) when it is neither."""
    try:
        return _map_decoder.decode(payload)
    except msgspec.ValidationError:
        old = _positional_decoder.decode(payload)
        return KVEventBatch(old.ts, list(old.events), old.data_parallel_rank)


def decode_batch_raw_tokens(payload: bytes) -> KVEventBatch:
    """`decode_batch` for the router's index: each BlockStored (still an instance of it)
    carries `token_ids` as the msgspec.Raw msgpack of the array, unchecked until hashed."""
    try:
        return _raw_map_decoder.decode(payload)
    except msgspec.ValidationError:
        old = _raw_positional_decoder.decode(payload)
        return KVEventBatch(old.ts, list(old.events), old.data_parallel_rank)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"KV event sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _topic_bytes(topic: str | bytes) -> bytes:
    return topic.encode() if isinstance(topic, str) else topic


def encode_frames(topic: str | bytes, seq: int, batch: KVEventBatch) -> list[bytes]:
    """The PUB message for one batch: [topic, seq, payload]."""
    return [_topic_bytes(topic), encode_seq(seq), encode_batch(batch)]


def replay_request(start_seq: int) -> list[bytes]:
    """What a subscriber's DEALER sends to the replay socket."""
    return [b"", encode_seq(start_seq)]


def replay_reply_frames(
    client_id: bytes, topic: str | bytes, buffered: Iterable[tuple[int, bytes]], start_seq: int
) -> Iterator[list[bytes]]:
    """The ROUTER's answer to a replay request: each buffered batch >= start_seq, then END."""
    topic_b = _topic_bytes(topic)
    for seq, payload in buffered:
        if seq >= start_seq:
            yield [client_id, b"", topic_b, encode_seq(seq), payload]
    yield [client_id, b"", b"", END_SEQ, b""]


class KVEventPublisher:
    """A PUB socket plus replay ROUTER speaking vLLM's protocol; one thread owns it.

    Endpoints with ``*`` bind (``tcp://*:5557``), like vLLM; others connect. The replay
    endpoint always binds. The last ``buffer_steps`` batches are kept for replay.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        ctx = context or zmq.Context.instance()
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        seq = self._seq
        self._seq += 1
        batch = KVEventBatch(
            time.time() if ts is None else ts, list(events), self.data_parallel_rank
        )
        payload = encode_batch(batch)
        self._pub.send_multipart([self.topic, encode_seq(seq), payload])
        self._buffer.append((seq, payload))
        self.service_replay()
        return seq

    def service_replay(self) -> int:
        """Answer pending replay requests without blocking; returns how many."""
        if self._replay is None:
            return 0
        served = 0
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for reply in replay_reply_frames(client_id, self.topic, self._buffer, start_seq):
                self._replay.send_multipart(reply)
            served += 1
        return served

    def close(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
