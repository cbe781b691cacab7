"""KvEventSubscriber over real ZeroMQ: live events, replay after a gap, fail open."""

from __future__ import annotations

import time

import pytest

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.router.kv_subscriber import KvEventSubscriber
from hpcserve.router.prefix_index import PrefixIndex
from tests.ports import free_port

BS = 4
TOKENS = list(range(40))
HASHES = prompt_block_hashes(TOKENS, BS)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    pub_port, replay_port = free_port(), free_port()
    pub = kw.KVEventPublisher(
        f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}", topic="r1"
    )
    clock = Clock()
    sub = KvEventSubscriber(PrefixIndex(), clock=clock, silence_s=5.0, replay_timeout_s=2.0)
    sub.watch("r1", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", "r1")
    yield pub, sub, clock
    sub.close()
    pub.close()


def pump(pub, sub, until, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.service_replay()
        sub.sub.poll(10)
        sub.drain()
        for sock in sub.replay_sockets():
            sock.poll(5)
            sub.on_replay(sock)
        sub.tick()
        if until():
            return
    raise AssertionError("condition not reached")


def block(i, parent=True):
    return kw.BlockStored([i], i - 1 if parent and i else None, TOKENS[i * BS : (i + 1) * BS], BS)


def depth(sub):
    return sub.index.match(HASHES).get("r1", 0)


def connect(pub, sub):
    """PUB drops until the subscription lands: publish block 0 until it arrives (and the
    first message's replay has ended)."""
    deadline = time.monotonic() + 10
    while (depth(sub) == 0 or sub.replay_sockets()) and time.monotonic() < deadline:
        pub.publish([block(0)])
        sub.sub.poll(20)
        sub.drain()
        for sock in sub.replay_sockets():
            sock.poll(20)
            sub.on_replay(sock)
    assert depth(sub) == 1


def test_live_events_fill_the_index(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    pub.publish([block(1), block(2)])
    pump(pub, sub, lambda: depth(sub) == 3)
    pub.publish([kw.BlockRemoved([2])])
    pump(pub, sub, lambda: depth(sub) == 2)


def test_a_gap_is_filled_from_the_replay_socket(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    # Lose two batches on the way (HWM-style loss): taken off the socket, never handled.
    pub.publish([block(1)])
    pub.publish([block(2)])
    for _ in range(2):
        assert sub.sub.poll(60_000), "a published batch never arrived"
        sub.sub.recv_multipart()
    deadline = time.monotonic() + 5
    while depth(sub) < 4 and time.monotonic() < deadline:
        pub.publish([block(3)])  # blocks 3 again and again: idempotent
        pump(pub, sub, lambda: True, 0.05)
    assert depth(sub) == 4
    assert sub.metrics.gaps._value.get() >= 1


def test_a_gap_without_replay_clears_the_replica(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    stream = next(iter(sub._streams.values()))
    stream.replay_endpoint = ""
    pub._seq += 5  # five batches lost on the way
    pub.publish([kw.BlockRemoved([99])])
    pump(pub, sub, lambda: depth(sub) == 0)


def test_all_blocks_cleared_makes_the_replica_cold(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    pub.publish([kw.AllBlocksCleared()])
    pump(pub, sub, lambda: depth(sub) == 0)


def test_silence_after_a_prompt_makes_the_replica_cold(setup):
    pub, sub, clock = setup
    connect(pub, sub)
    sub.prompt_sent("r1")
    clock.now = 4.0
    sub.tick()
    assert depth(sub) == 1
    clock.now = 6.0
    sub.tick()
    assert depth(sub) == 0


def test_unwatch_forgets_the_replica(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    sub.unwatch("r1")
    assert not sub.watching("r1") and depth(sub) == 0


def test_garbage_is_counted_not_fatal(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    pub._pub.send_multipart([b"r1", kw.encode_seq(pub.next_seq), b"\xc1"])
    pub._seq += 1
    pub._pub.send_multipart([b"r1", b"short"])
    pump(pub, sub, lambda: sub.metrics.bad._value.get() >= 2)
    pub.publish([block(1)])
    pump(pub, sub, lambda: depth(sub) == 2)


def test_a_message_of_another_shape_costs_at_most_the_next_one_which_replay_heals(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    # Four frames: counted bad, the rest of it skipped.
    pub._pub.send_multipart([b"r1", kw.encode_seq(pub.next_seq), b"\xc1", b"extra"])
    pump(pub, sub, lambda: sub.metrics.bad._value.get() >= 1)
    # Two frames with a good message queued behind it: the subscriber reads three frames
    # per message, so the good one is taken along (counted bad with it); its stream then
    # sees a gap at the next message and replays what it missed.
    pub._pub.send_multipart([b"r1", b"short"])
    pub.publish([block(1)])
    pub.publish([block(2)])
    pump(pub, sub, lambda: depth(sub) == 3)
    assert sub.metrics.bad._value.get() >= 2


def test_the_frames_after_a_long_message_are_skipped_exactly(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    gaps = sub.metrics.gaps._value.get()
    # Five frames, its seq not taken: the extra two are skipped and nothing after them is,
    # so the next batch (that seq) is applied in order, with no gap and no replay.
    pub._pub.send_multipart([b"r1", kw.encode_seq(pub.next_seq), b"\xc1", b"x", b"y"])
    pub.publish([block(1)])
    pump(pub, sub, lambda: depth(sub) == 2)
    assert sub.metrics.bad._value.get() == 1
    assert sub.metrics.gaps._value.get() == gaps and not sub.replay_sockets()


def test_events_of_an_unknown_topic_are_ignored(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    cleared = kw.KVEventBatch(0.0, [kw.AllBlocksCleared()])
    pub._pub.send_multipart(kw.encode_frames("someone-else", 0, cleared))
    pub.publish([block(1)])
    pump(pub, sub, lambda: depth(sub) == 2)


def test_a_stored_event_with_bad_token_ids_is_counted_not_fatal(setup):
    pub, sub, _ = setup
    connect(pub, sub)
    # Decodable, but its token_ids are not token ids: the hash (from the raw msgpack) refuses them.
    pub.publish([kw.BlockStored([1], 0, [4, 5, -1, 7], BS)])
    pub.publish([kw.BlockStored([1], 0, ["a", "b", "c", "d"], BS)])
    pump(pub, sub, lambda: sub.metrics.bad._value.get() >= 2)
    assert depth(sub) == 1
    pub.publish([block(1)])
    pump(pub, sub, lambda: depth(sub) == 2)


def test_ingest_counts_are_scraped_as_counters(setup):
    pub, sub, _ = setup
    connect(pub, sub)  # applies at least one batch storing block 0
    before = sub.metrics.ingest.batches
    pub.publish([block(1), block(2), kw.BlockRemoved([2])])
    pump(pub, sub, lambda: depth(sub) == 2)
    scraped = {
        sample.name: sample.value
        for family in sub.metrics.ingest.collect()
        for sample in family.samples
    }
    assert scraped["hpcserve_router_kv_batches_total"] == before + 1
    assert scraped["hpcserve_router_kv_blocks_stored_total"] == before + 2
    assert scraped["hpcserve_router_kv_blocks_removed_total"] == 1
