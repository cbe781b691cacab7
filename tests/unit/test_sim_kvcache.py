"""The simulator's paged KV cache: prefix hits, vLLM-shaped events, LRU eviction."""

from __future__ import annotations

import pytest

from hpcserve.sim.kvcache import Cleared, KVCache, Removed, Stored, block_hash


def test_a_repeated_prompt_hits_its_full_blocks_but_never_the_last_token() -> None:
    kv = KVCache(num_blocks=16, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.lookup("a", prompt) == 0
    assert kv.allocate("a", 10)
    kv.commit("a", prompt, 10)
    kv.free("a")
    assert kv.lookup("b", prompt) == 8
    assert (kv.queries, kv.hits) == (20, 8)
    # A prompt of exactly two blocks reuses only one: the last token must be computed.
    kv.free("b")
    assert kv.lookup("c", prompt[:8]) == 4


def test_stored_events_chain_parents_and_carry_the_token_ids() -> None:
    kv = KVCache(num_blocks=16, block_size=4)
    tokens = list(range(100, 113))
    kv.lookup("a", tokens)
    kv.allocate("a", 13)
    kv.commit("a", tokens, 6)  # one full block so far
    kv.commit("a", tokens, 13)  # two more
    first, second = kv.take_events()
    assert isinstance(first, Stored) and isinstance(second, Stored)
    h0 = block_hash(None, tokens[0:4])
    h1 = block_hash(h0, tokens[4:8])
    h2 = block_hash(h1, tokens[8:12])
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (
        [h0],
        None,
        tokens[:4],
    )
    assert (second.block_hashes, second.parent_block_hash) == ([h1, h2], h0)
    assert second.token_ids == tokens[4:12] and second.block_size == 4
    # A cache hit produces no event.
    kv.free("a")
    kv.lookup("b", tokens)
    assert kv.take_events() == []


def test_eviction_takes_the_least_recently_freed_blocks_tail_first() -> None:
    kv = KVCache(num_blocks=4, block_size=2)
    a = [1, 2, 3, 4]
    kv.lookup("a", a)
    kv.allocate("a", 4)
    kv.commit("a", a, 4)
    kv.free("a")  # both blocks cached and free; a's tail is evicted before its head
    kv.take_events()
    b = [9, 9, 8, 8, 7]
    kv.lookup("b", b)
    assert kv.allocate("b", 5)  # 3 blocks: 2 never used, then a's tail
    (removed,) = kv.take_events()
    assert removed == Removed([block_hash(block_hash(None, [1, 2]), [3, 4])])
    assert kv.lookup("c", [1, 2, 3]) == 2  # a's first block survived
    assert kv.usage == 1.0
    assert not kv.allocate("d", 1)


def test_usage_counts_referenced_blocks_and_reset_clears_only_an_idle_cache() -> None:
    kv = KVCache(num_blocks=10, block_size=4)
    kv.lookup("a", list(range(8)))
    kv.allocate("a", 8)
    kv.commit("a", list(range(8)), 8)
    assert kv.usage == pytest.approx(0.2)
    assert not kv.reset()
    kv.free("a")
    assert kv.usage == 0.0
    kv.take_events()
    assert kv.reset()
    assert kv.take_events() == [Cleared()]
    assert kv.lookup("b", list(range(8))) == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="blocks >= 1"):
        KVCache(num_blocks=0, block_size=16)
