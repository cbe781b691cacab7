"""Sampled prefix hashes (gateway.prefix_hash_stride, protocol.Route.hash_stride): the
gateway sends every k-th full block's hash and the last; the router reads n held hashes as
min(n x k, hashed_blocks) blocks, from KV events (every block indexed) and from what it
recorded itself (approximate mode: the samples)."""

from __future__ import annotations

from array import array

import pytest

from hpcserve.config import RoutingConfig
from hpcserve.contracts import protocol as p
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.contracts.prompt_tokens import hash_fields, hash_stride
from hpcserve.router.decide import Decider
from hpcserve.router.registry import Registry

BS = 16
H = list(range(101, 111))  # ten blocks' hashes, h[i] = 101 + i


@pytest.mark.parametrize(
    ("hashes", "stride", "expected"),
    [
        ([], 4, {"block_hashes": [], "block_size": BS}),
        (H[:1], 4, {"block_hashes": [101], "block_size": BS}),
        (H, 1, {"block_hashes": H, "block_size": BS}),
        (H[:3], 4, {"block_hashes": [103], "block_size": BS, "hash_stride": 4, "hashed_blocks": 3}),
        (H[:8], 4, {"block_hashes": [104, 108], "block_size": BS, "hash_stride": 4, "hashed_blocks": 8}),
        (H, 4, {"block_hashes": [104, 108, 110], "block_size": BS, "hash_stride": 4, "hashed_blocks": 10}),
        (H, 3, {"block_hashes": [103, 106, 109, 110], "block_size": BS, "hash_stride": 3, "hashed_blocks": 10}),
        (array("q", H), 4, {"block_hashes": [104, 108, 110], "block_size": BS, "hash_stride": 4, "hashed_blocks": 10}),
    ],
)  # fmt: skip
def test_hash_fields_sample_every_kth_block_and_the_last(hashes, stride, expected):
    fields = hash_fields(hashes, BS, stride)
    assert fields == expected
    assert all(type(h) is int for h in fields["block_hashes"])
    p.Route(1, "m", **fields)  # the fields are Route's


@pytest.mark.parametrize(
    ("every_tokens", "block_size", "stride"),
    [(64, 16, 4), (64, 128, 1), (100, 16, 6), (1, 16, 1), (4096, 16, 256)],
)
def test_the_stride_is_whole_blocks_per_configured_tokens(every_tokens, block_size, stride):
    assert hash_stride(every_tokens, block_size) == stride


def decider():
    registry = Registry(lease_s=600.0)
    for rid in ("a", "b"):
        registry.register(p.Register(rid, "m", f"http://{rid}", block_size=BS), 0.0)
    return Decider(RoutingConfig(max_share=1.0), registry), registry.table("m")


def cached_by_replica(dec, table, route: p.Route) -> dict[str, int]:
    cached = dec.cached_tokens(dec.request_of(route, "m"), table)
    if cached is None:
        return {}
    return {r.replica_id: cached.at(r.row) for r in table.replicas if cached.at(r.row)}


@pytest.mark.parametrize(
    ("held_blocks", "stride", "expected_blocks"),
    [
        (10, 1, 10),
        (6, 1, 6),
        (10, 4, 10),  # every sample held, the last one too: exact
        (9, 4, 8),  # the last (block 10) missing: up to the 8th
        (6, 4, 4),  # the 4th held, the 8th not
        (3, 4, 0),  # not even the first sample
        (10, 3, 10),
        (7, 3, 6),
    ],
)
def test_the_router_counts_sampled_hashes_as_blocks(held_blocks, stride, expected_blocks):
    """With KV events the index holds every block the engine stored; a sampled Route is
    matched at the stride's granularity, and exactly when the whole prompt is held."""
    dec, table = decider()
    tokens = list(range(5000, 5000 + 10 * BS + 7))
    chain = prompt_block_hashes(tokens, BS)
    assert len(chain) == 10
    dec.index.add_hashes(dec.index.slot("a"), chain[:held_blocks])
    route = p.Route(1, "m", prompt_tokens=len(tokens), **hash_fields(chain, BS, stride))
    expected = {"a": expected_blocks * BS} if expected_blocks else {}
    assert cached_by_replica(dec, table, route) == expected
    assert dec.request_of(route, "m").prompt_tokens == len(tokens)


def test_approximate_mode_matches_what_it_recorded_at_the_stride():
    """Without KV events the router records the blocks it routed (the samples): a later
    prompt sharing the first one's leading blocks finds them on the replica it went to,
    to the last shared sample."""
    dec, table = decider()
    first = list(range(7000, 7000 + 10 * BS))
    chain = prompt_block_hashes(first, BS)
    picked = dec.pick(p.Route(1, "m", prompt_tokens=len(first), **hash_fields(chain, BS, 4)), 1.0)
    assert picked is not None
    dec.record_routed()
    longer = first + list(range(9000, 9000 + 6 * BS))  # 16 blocks, the first 10 shared
    longer_chain = prompt_block_hashes(longer, BS)
    route = p.Route(2, "m", prompt_tokens=len(longer), **hash_fields(longer_chain, BS, 4))
    # Samples 4, 8 recorded (12, 16 are new; the first prompt's last sample, 10, is not one
    # of the longer prompt's): 8 blocks.
    assert cached_by_replica(dec, table, route) == {picked.replica_id: 8 * BS}
    same = p.Route(3, "m", prompt_tokens=len(first), **hash_fields(chain, BS, 4))
    assert cached_by_replica(dec, table, same) == {picked.replica_id: 10 * BS}


def test_a_short_prompt_with_one_sampled_hash_still_matches():
    dec, table = decider()
    tokens = list(range(300, 300 + 2 * BS + 3))  # two full blocks: fewer than the stride
    chain = prompt_block_hashes(tokens, BS)
    dec.index.add_hashes(dec.index.slot("b"), chain)
    route = p.Route(1, "m", prompt_tokens=len(tokens), **hash_fields(chain, BS, 4))
    assert route.block_hashes == [chain[-1]]
    assert cached_by_replica(dec, table, route) == {"b": 2 * BS}


def test_a_route_claiming_more_blocks_than_its_samples_cover_is_bounded():
    dec, _ = decider()
    claims = p.Route(
        1, "m", block_hashes=[1, 2], block_size=BS, hash_stride=2**70, hashed_blocks=2**80
    )
    request = dec.request_of(claims, "m")
    assert request.hash_stride == 4096 and request.hashed_blocks == 2 * 4096
    plain = dec.request_of(p.Route(2, "m", block_hashes=[1, 2, 3], block_size=BS), "m")
    assert (plain.hash_stride, plain.hashed_blocks, plain.prompt_tokens) == (1, 3, 3 * BS)
