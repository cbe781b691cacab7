"""vLLM's KV-event wire: both payload layouts, framing, replay, the publisher."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from hpcserve.contracts import kv_wire as kw
from tests.ports import free_port

# What vLLM 0.32's ZmqEventPublisher encodes (msgspec of its KVEventBatch), built by hand.
VLLM_032_PAYLOAD = msgspec.msgpack.encode(
    [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [b"a" * 32, b"b" * 32],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {"type": "BlockRemoved", "block_hashes": [b"a" * 32], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
)

# An earlier release: events as positional arrays, fewer fields.
POSITIONAL_PAYLOAD = msgspec.msgpack.encode(
    [
        2.0,
        [
            ["BlockStored", [7, 8], 6, [1, 2, 3, 4], 2, None],
            ["BlockRemoved", [7]],
            ["AllBlocksCleared"],
        ],
    ]
)


def test_decodes_the_named_map_layout_of_vllm_0_32():
    batch = kw.decode_batch(VLLM_032_PAYLOAD)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, kw.BlockStored)
    assert stored.block_hashes == [b"a" * 32, b"b" * 32]
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2
    assert stored.parent_block_hash is None and stored.group_idx == 0
    assert isinstance(removed, kw.BlockRemoved) and removed.block_hashes == [b"a" * 32]
    assert isinstance(cleared, kw.AllBlocksCleared)


def test_decodes_the_positional_layout_into_the_same_classes():
    batch = kw.decode_batch(POSITIONAL_PAYLOAD)
    stored, removed, cleared = batch.events
    assert isinstance(stored, kw.BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash) == ([7, 8], 6)
    assert stored.token_ids == [1, 2, 3, 4] and stored.lora_name is None
    assert isinstance(removed, kw.BlockRemoved) and removed.block_hashes == [7]
    assert isinstance(cleared, kw.AllBlocksCleared)
    assert batch.data_parallel_rank is None


def test_encoding_round_trips_in_both_layouts():
    batch = kw.KVEventBatch(
        3.0,
        [
            kw.BlockStored([1, 2], None, [5, 6, 7, 8], 2, lora_name="ad"),
            kw.BlockRemoved([1]),
            kw.AllBlocksCleared(),
        ],
        0,
    )
    assert kw.decode_batch(kw.encode_batch(batch)) == batch
    again = kw.decode_batch(kw.encode_positional_batch(batch))
    assert [type(e).__mro__[1] for e in again.events[:2]] == [kw.BlockStored, kw.BlockRemoved]
    assert again.events[0].lora_name == "ad" and again.events[0].token_ids == [5, 6, 7, 8]


def test_encoded_events_are_maps_tagged_by_type_like_vllm():
    raw = msgspec.msgpack.decode(kw.encode_batch(kw.KVEventBatch(1.0, [kw.BlockRemoved([3])], 0)))
    assert raw[0] == 1.0 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockRemoved" and raw[1][0]["block_hashes"] == [3]


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"x": 1})])
def test_garbage_is_a_decode_error(payload):
    with pytest.raises(msgspec.DecodeError):
        kw.decode_batch(payload)


def test_sequence_frames():
    assert kw.decode_seq(kw.encode_seq(5)) == 5
    assert kw.decode_seq(kw.END_SEQ) == -1
    assert kw.encode_seq(1) == (1).to_bytes(8, "big")
    with pytest.raises(ValueError, match="8 bytes"):
        kw.decode_seq(b"\x01")


def test_replay_reply_sends_buffered_batches_from_start_then_end_marker():
    frames = list(kw.replay_reply_frames(b"id", "t", [(0, b"p0"), (1, b"p1"), (2, b"p2")], 1))
    assert frames == [
        [b"id", b"", b"t", kw.encode_seq(1), b"p1"],
        [b"id", b"", b"t", kw.encode_seq(2), b"p2"],
        [b"id", b"", b"", kw.END_SEQ, b""],
    ]


def test_publisher_speaks_pub_and_replay_protocols():
    pub_port, replay_port = free_port(), free_port()
    ctx = zmq.Context.instance()
    pub = kw.KVEventPublisher(
        f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv"
    )
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        received = None
        # PUB drops messages until the subscription has propagated: publish until one lands.
        for _ in range(200):
            pub.publish([kw.BlockRemoved([9])])
            if sub.poll(20):
                received = sub.recv_multipart()
                break
        assert received is not None
        topic, seq, payload = received
        assert topic == b"kv" and kw.decode_batch(payload).events == [kw.BlockRemoved([9])]
        last = kw.decode_seq(seq)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart(kw.replay_request(last))
        replies = []
        for _ in range(200):
            pub.service_replay()
            while dealer.poll(10):
                replies.append(dealer.recv_multipart())
            if replies and replies[-1][2] == kw.END_SEQ:
                break
        assert [kw.decode_seq(r[2]) for r in replies] == [*range(last, pub.next_seq), -1]
        assert all(r[0] == b"" for r in replies)
    finally:
        sub.close(0)
        dealer.close(0)
        pub.close()
