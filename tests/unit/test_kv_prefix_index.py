"""PrefixIndex: our chained hashes from BlockStored, removal by the engine's hash."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.prefix_hash import (
    chain_hashes,
    chain_seed,
    prompt_block_hashes,
)
from hpcserve.router.prefix_index import PrefixIndex

BS = 4
PROMPT = list(range(100, 118))  # 4 full blocks and a partial one


def stored(hashes, tokens, parent=None, lora=None):
    return kw.BlockStored(hashes, parent, list(tokens), BS, lora_name=lora)


def test_prompt_hashes_cover_full_blocks_only_and_chain():
    hashes = prompt_block_hashes(PROMPT, BS)
    assert len(hashes) == 4
    assert hashes[:2] == prompt_block_hashes(PROMPT[:8], BS)
    # A different first block changes every later hash.
    other = prompt_block_hashes([0, *PROMPT[1:]], BS)
    assert all(a != b for a, b in zip(hashes, other, strict=True))
    assert all(-(2**63) <= h < 2**63 for h in hashes)  # a C hash: a small int each


def test_the_adapter_is_mixed_into_the_chain():
    assert chain_seed("") != chain_seed("a") != chain_seed("b")
    assert prompt_block_hashes(PROMPT, BS, "a")[0] != prompt_block_hashes(PROMPT, BS)[0]


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes(PROMPT, 0, 1)


def test_stored_blocks_match_the_request_side_hashes():
    index = PrefixIndex()
    index.apply("r1", [stored([b"e1", b"e2"], PROMPT[:8])])
    index.apply("r1", [stored([b"e3"], PROMPT[8:12], parent=b"e2")])
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {"r1": 3}
    assert index.blocks("r1") == 3 and index.block_size("r1") == BS


def test_match_reports_each_replicas_own_depth():
    index = PrefixIndex()
    index.apply("a", [stored([1, 2, 3], PROMPT[:12])])
    index.apply("b", [stored([9], PROMPT[:4])])
    index.apply("c", [stored([5], [0, 0, 0, 0])])
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {"a": 3, "b": 1}
    assert index.match([]) == {}
    assert index.match(prompt_block_hashes([7] * 8, BS)) == {}


def test_block_removed_follows_the_engine():
    index = PrefixIndex()
    index.apply("a", [stored([1, 2, 3], PROMPT[:12])])
    index.apply("a", [kw.BlockRemoved([2])])
    # Block 2 is gone, so only block 1 is a usable prefix (3 hangs on a missing parent).
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {"a": 1}
    index.apply("a", [kw.BlockRemoved([1, 3, 99])])
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {}
    assert len(index) == 0


def test_all_blocks_cleared_and_drop():
    index = PrefixIndex()
    index.apply("a", [stored([1, 2], PROMPT[:8])])
    index.apply("b", [stored([1, 2], PROMPT[:8])])
    index.apply("a", [kw.AllBlocksCleared()])
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {"b": 2}
    index.drop("b")
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {} and len(index) == 0
    # A dropped replica's slot is reused without inheriting anything.
    index.apply("c", [stored([4], PROMPT[:4])])
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {"c": 1}


def test_a_child_of_an_unknown_parent_is_an_orphan_not_a_wrong_entry():
    index = PrefixIndex()
    index.apply("a", [stored([2], PROMPT[4:8], parent=b"never-seen")])
    assert index.orphans == 1 and len(index) == 0


def test_lora_blocks_match_only_requests_for_that_adapter():
    index = PrefixIndex()
    index.apply("a", [stored([1], PROMPT[:4], lora="sql")])
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {}
    assert index.match(prompt_block_hashes(PROMPT, BS, "sql")) == {"a": 1}


def test_int_and_bytes_engine_hashes_both_work():
    index = PrefixIndex()
    index.apply("a", [stored([b"x" * 32], PROMPT[:4])])
    index.apply("a", [stored([17], PROMPT[4:8], parent=b"x" * 32)])
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {"a": 2}


def test_hashes_agree_across_processes_whatever_their_hash_seed():
    """The gateway and the router are different processes: str/bytes hashes differ between
    them, the chain (tuples of ints, the adapter through blake2b) must not."""
    code = (
        "from hpcserve.contracts.prefix_hash import prompt_block_hashes as p;"
        f"print(p({PROMPT!r}, {BS}), p({PROMPT!r}, {BS}, 'sql'))"
    )
    mine = f"{prompt_block_hashes(PROMPT, BS)} {prompt_block_hashes(PROMPT, BS, 'sql')}"
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert out == mine


def test_routed_blocks_are_pending_until_events_store_them_and_only_unstored_ones_expire():
    from hpcserve.router.approx_index import RoutedPrefixes

    index = PrefixIndex()
    routed = RoutedPrefixes(index, ttl_s=120.0, max_blocks=1000)
    tokens = list(range(4 * BS))
    hashes = prompt_block_hashes(tokens, BS)
    index.slot("r0")
    routed.routed("r0", hashes, now=0.0, ttl_s=5.0)
    assert index.match(hashes) == {"r0": 4}  # pending: the next request finds them
    # The engine stores the first three blocks: they are its now, not pending.
    index.apply("r0", [stored([b"a", b"b", b"c"], tokens[: 3 * BS])])
    assert len(index.unconfirmed(index.slot("r0"))) == 1
    routed.expire(10.0)
    assert index.match(hashes) == {"r0": 3}  # the unstored fourth expired, nothing else
    # The prefix the replica holds (skip, as the Decider passes it) is not recorded, so no
    # expiry can remove it.
    routed.routed("r0", hashes, now=20.0, ttl_s=5.0, skip=3)
    assert list(index.unconfirmed(index.slot("r0"))) == hashes[3:]
    routed.expire(30.0)
    assert index.match(hashes) == {"r0": 3}


def test_a_dropped_replica_takes_its_routed_blocks_along():
    from hpcserve.router.approx_index import RoutedPrefixes

    index = PrefixIndex()
    routed = RoutedPrefixes(index, ttl_s=120.0, max_blocks=1000)
    hashes = prompt_block_hashes(list(range(4 * BS)), BS)
    routed.routed("r0", hashes, now=0.0)
    index.drop("r0")
    assert index.slot("r1") == 0  # the slot is reused ...
    assert index.match(hashes) == {}  # ... without the blocks routed to r0
    assert len(index) == 0


def _match_reference(holders: dict[int, int], hashes: list[int]) -> dict[int, int]:
    """Slot -> matched depth, walking every block in Python (what match_slots computes)."""
    depths: dict[int, int] = {}
    alive = holders.get(hashes[0], 0) if hashes else 0
    slot_bits = {s for s in range(alive.bit_length()) if alive >> s & 1}
    depth = 0
    for h in hashes:
        mask = holders.get(h, 0)
        for s in list(slot_bits):
            if not mask >> s & 1:
                depths[s] = depth
                slot_bits.discard(s)
        if not slot_bits:
            break
        depth += 1
    for s in slot_bits:
        depths[s] = depth
    return depths


@pytest.mark.parametrize("replicas", [1, 3, 64, 70])  # 64 and up: masks wider than a word
@pytest.mark.parametrize("seed", range(4))
def test_compiled_walk_matches_the_reference_for_any_holders(replicas, seed):
    import random

    rng = random.Random(seed)
    index = PrefixIndex()
    prompts = [
        prompt_block_hashes([rng.randrange(1000) for _ in range(40 * BS)], BS) for _ in range(3)
    ]
    for r in range(replicas):
        slot = index.slot(f"r{r}")
        prompt = prompts[rng.randrange(3)]
        held = prompt[: rng.randrange(len(prompt) + 1)]
        if rng.random() < 0.3 and held:  # a gap: an evicted block in the middle
            held = held[: len(held) // 2] + held[len(held) // 2 + 1 :]
        index.add_hashes(slot, held)
    for prompt in prompts:
        for cut in (0, 1, 7, len(prompt)):
            asked = prompt[:cut]
            slots, depths = index.match_slots(asked)
            got = dict(zip(slots, depths, strict=True))
            want = _match_reference(index._holders, asked)
            assert got == {s: d for s, d in want.items() if d > 0}


def test_routed_blocks_are_renewed_only_near_their_expiry():
    from hpcserve.router.approx_index import RoutedPrefixes

    index = PrefixIndex()
    routed = RoutedPrefixes(index, ttl_s=80.0, max_blocks=1000)
    hashes = prompt_block_hashes(list(range(4 * BS)), BS)
    routed.routed("r0", hashes[:2], now=0.0)
    recent = index.unconfirmed(index.slot("r0"))
    assert list(recent.items()) == [(hashes[0], 80.0), (hashes[1], 80.0)]
    # 5 s later (under 1/8 of the TTL): the two kept as they are, the new ones added at the end
    routed.routed("r0", hashes, now=5.0)
    assert list(recent.items()) == [
        (hashes[0], 80.0), (hashes[1], 80.0), (hashes[2], 85.0), (hashes[3], 85.0)
    ]  # fmt: skip
    # 20 s later: more than 1/8 of the TTL gone, renewed in place
    routed.routed("r0", hashes[:3], now=20.0)
    assert list(recent.items()) == [
        (hashes[0], 100.0), (hashes[1], 100.0), (hashes[2], 100.0), (hashes[3], 85.0)
    ]  # fmt: skip
    assert index.match(hashes) == {"r0": 4}
    routed.expire(101.0)
    assert index.match(hashes) == {}


def test_noting_routed_blocks_keeps_a_single_holders_shared_bit_and_ors_others():
    index = PrefixIndex()
    a, b = index.slot("a"), index.slot("b")
    hashes = prompt_block_hashes(list(range(3 * BS)), BS)
    index.note_routed(a, hashes, 0, 10.0, 5.0)
    bit_a = index._bits[a]
    assert all(index._holders[h] is bit_a for h in hashes)
    index.note_routed(b, hashes, 1, 10.0, 5.0)  # from the second block on
    assert [index._holders[h] for h in hashes] == [1, 3, 3]
    assert index.match(hashes) == {"a": 3}  # b lacks the first block: no match for it
