"""contracts/_blockhash.c: the same chained hashes as prefix_hash.chain_hashes_reference, from
a sequence of ints and from the raw msgpack of a BlockStored event's token_ids; bad input
refused with the problem named; the import-time guards."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import msgspec
import pytest

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts import prefix_hash as ph
from hpcserve.router.prefix_index import PrefixIndex

PARENTS = [0, 1, -1, -2, 2, 2**61 - 2, 2**61 - 1, 2**61, 2**62, -(2**61) + 1, -(2**61)]
PARENTS += [
    2**63 - 1,
    -(2**63),
    2**64 + 5,
    -(2**100),
    2**200,
    ph.chain_seed(""),
    ph.chain_seed("a"),
]
ID_LIMITS = [127, 255, 65_535, 2**32 - 1, 2**64 - 1]  # fixint, uint8, uint16, uint32, uint64


def test_compiled_hashes_equal_the_reference_on_random_tokens():
    rng = random.Random(7)
    encode = msgspec.msgpack.encode
    for case in range(1_500):
        block_size = rng.choice([1, 16, 17])
        limit = ID_LIMITS[case % len(ID_LIMITS)]
        tokens = [rng.randint(0, rng.choice([127, limit])) for _ in range(rng.randrange(70))]
        parent = rng.choice([*PARENTS, rng.getrandbits(64) - 2**63, rng.getrandbits(70)])
        want = ph.chain_hashes_reference(tokens, block_size, parent)
        assert len(want) == len(tokens) // block_size  # the partial tail is dropped
        assert ph.chain_hashes(tokens, block_size, parent) == want
        assert ph.chain_hashes(tuple(tokens), block_size, parent) == want
        assert ph.chain_hashes_msgpack(encode(tokens), block_size, parent) == want
        assert ph.chain_hashes_msgpack(encode(tokens), block_size, parent, 2) == want[:2]


def test_sequences_hash_any_int_like_python():
    # The gateway's path hashes whatever the tuple would (negative, huge, bool).
    tokens = [-1, -2, 2**61 - 1, 2**70, -(2**70), True, 0, 5]
    for parent in PARENTS:
        assert ph.chain_hashes(tokens, 2, parent) == ph.chain_hashes_reference(tokens, 2, parent)


def test_a_list_changed_by_an_items_hash_is_hashed_as_it_was():
    class Meddling(int):
        def __hash__(self):
            tokens.clear()  # would leave the C loop reading freed items
            return 7

    tokens = [1, 2, Meddling(3), 4] * 50
    snapshot = tuple(tokens)
    assert ph.chain_hashes(tokens, 4, 0) == ph.chain_hashes_reference(snapshot, 4, 0)


@pytest.mark.parametrize(
    ("encoded", "value"),
    [
        (b"\x05", 5),  # positive fixint
        (b"\xcc\xff", 255),  # uint8
        (b"\xcd\xff\xfe", 65_534),  # uint16
        (b"\xce\xff\xff\xff\xff", 2**32 - 1),  # uint32
        (b"\xcf" + (2**64 - 1).to_bytes(8, "big"), 2**64 - 1),  # uint64
        (b"\xcf" + (2**61 - 1).to_bytes(8, "big"), 2**61 - 1),  # hashes to 0
        (b"\xd0\x7f", 127),  # signed encodings of non-negative values are read too
        (b"\xd1\x01\x00", 256),
        (b"\xd2\x00\x01\x00\x00", 65_536),
        (b"\xd3" + (2**40).to_bytes(8, "big"), 2**40),
    ],
)
def test_every_msgpack_int_encoding_of_a_token_id(encoded, value):
    raw = b"\x92" + encoded + b"\x01"
    want = ph.chain_hashes_reference([value, 1], 2, 3)
    assert ph.chain_hashes_msgpack(raw, 2, 3) == want


def test_array_headers_of_every_width():
    tokens = list(range(20))
    for header in (b"\x9f", b"\xdc\x00\x0f", b"\xdd\x00\x00\x00\x0f"):  # fixarray, 16, 32
        raw = header + bytes(range(15))
        assert ph.chain_hashes_msgpack(raw, 4, 0) == ph.chain_hashes_reference(tokens[:15], 4, 0)
        assert ph.msgpack_array_length(raw) == 15
    big = list(range(70_000))  # array32
    assert ph.chain_hashes_msgpack(msgspec.msgpack.encode(big), 16, 9) == ph.chain_hashes(
        big, 16, 9
    )


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"", "empty input"),
        (b"\xa3abc", "expected a msgpack array, found type byte 0xa3"),
        (msgspec.msgpack.encode({"a": 1}), "expected a msgpack array"),
        (msgspec.msgpack.encode([1, -1]), "item 1 is negative \\(-1\\)"),
        (b"\x92\x01\xd0\x80", "item 1 is negative \\(-128\\)"),
        (b"\x91\xd1\xff\xfe", "item 0 is negative \\(-2\\)"),
        (b"\x91\xd2\xff\xff\xff\xff", "item 0 is negative \\(-1\\)"),
        (
            b"\x91\xd3" + (-(2**63)).to_bytes(8, "big", signed=True),
            "item 0 is negative \\(-9223372036854775808\\)",
        ),
        (msgspec.msgpack.encode([1, "x"]), "item 1 is not an integer \\(msgpack type byte 0xa1"),
        (msgspec.msgpack.encode([1.0]), "item 0 is not an integer"),
        (msgspec.msgpack.encode([None]), "item 0 is not an integer"),
        (msgspec.msgpack.encode([[1]]), "item 0 is not an integer"),
        (b"\x92\x01\xcd\x01", "truncated at item 1"),
        (b"\x92\x01", "the array claims 2 items but only 1 bytes follow"),
        (b"\xdc\x00", "truncated array header"),
        (msgspec.msgpack.encode([1, 2]) + b"\x00", "1 bytes after the array"),
        # Checked past the last hashed block too.
        (msgspec.msgpack.encode([1, 2, 3, "tail"]), "item 3 is not an integer"),
    ],
)
def test_malformed_token_arrays_are_refused_naming_the_problem(raw, problem):
    with pytest.raises(ValueError, match=f"token_ids: {problem}"):
        ph.chain_hashes_msgpack(raw, 2, 0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="block_size must be > 0, got 0"):
        ph.chain_hashes_msgpack(b"\x90", 0, 0)
    with pytest.raises(TypeError, match="msgpack bytes"):
        ph.chain_hashes_msgpack([1, 2], 1, 0)
    with pytest.raises(TypeError, match="parent must be an int"):
        ph.chain_hashes([1], 1, "p")
    with pytest.raises(TypeError, match="sequence"):
        ph.chain_hashes(5, 1, 0)
    with pytest.raises(TypeError, match="unhashable"):
        ph.chain_hashes([[1]], 1, 0)


def test_a_disagreeing_extension_is_refused(monkeypatch):
    ph._check_parity()  # the real one agrees
    monkeypatch.setattr(ph, "chain_hashes", lambda tokens, size, parent: [0])
    with pytest.raises(RuntimeError, match=r"disagrees with prefix_hash\.chain_hashes_reference"):
        ph._check_parity()


@pytest.mark.parametrize(
    ("stand_in", "message"),
    [
        ("None", "_blockhash \\(contracts/_blockhash.c\\) is not built: run `pip install -e .`"),
        ("types.ModuleType('stale')", "stale build \\(API None, this code needs 3\\)"),
    ],
)
def test_a_missing_or_stale_extension_names_the_fix(stand_in, message):
    code = (
        "import sys, types\n"
        f"sys.modules['hpcserve.contracts._blockhash'] = {stand_in}\n"
        "import hpcserve.contracts.prefix_hash\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("ImportError")
    assert re.search(message, result.stderr)


# --- the index's ingest path: token_ids as raw msgpack ----------------------------------

TOKENS = list(range(1000, 1040))  # 10 blocks of 4


def batch(*events):
    return kw.KVEventBatch(1.0, list(events), 0)


@pytest.mark.parametrize("encode", [kw.encode_batch, kw.encode_positional_batch])
def test_raw_token_decode_reads_both_layouts(encode):
    events = [
        kw.BlockStored([b"a", b"b"], None, TOKENS[:8], 4, lora_name="ad"),
        kw.BlockRemoved([b"a"]),
        kw.AllBlocksCleared(),
    ]
    raw = kw.decode_batch_raw_tokens(encode(batch(*events)))
    stored = raw.events[0]
    assert isinstance(stored, kw.BlockStored) and isinstance(stored.token_ids, msgspec.Raw)
    assert msgspec.msgpack.decode(stored.token_ids) == TOKENS[:8]
    assert (stored.block_hashes, stored.block_size, stored.lora_name) == ([b"a", b"b"], 4, "ad")
    assert isinstance(raw.events[1], kw.BlockRemoved) and raw.events[1].block_hashes == [b"a"]
    assert isinstance(raw.events[2], kw.AllBlocksCleared)


def test_raw_token_decode_of_an_event_without_token_ids():
    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1]}]])
    (stored,) = kw.decode_batch_raw_tokens(payload).events
    assert bytes(stored.token_ids) == b"\x90"


@pytest.mark.parametrize("encode", [kw.encode_batch, kw.encode_positional_batch])
def test_raw_and_decoded_events_build_the_same_index(encode):
    events = [
        kw.BlockStored([1, 2, 3], None, TOKENS[:14], 4),  # a partial tail past 3 blocks
        kw.BlockStored([4, 5], 3, TOKENS[12:20], 4),
        kw.BlockStored([6], None, TOKENS[:4], 4, lora_name="ad"),
        kw.BlockStored([7, 8], 6, TOKENS[4:12], 0),  # no block size: from the token count
        kw.BlockStored([9, 10], 5, TOKENS[20:24], 4),  # too few tokens: an orphan
        kw.BlockRemoved([2]),
    ]
    payload = encode(batch(*events))
    decoded, raw = PrefixIndex(), PrefixIndex()
    assert decoded.apply("r", kw.decode_batch(payload).events) == (10, 1)
    assert raw.apply("r", kw.decode_batch_raw_tokens(payload).events) == (10, 1)
    for tokens, adapter in [(TOKENS, ""), (TOKENS[:12], "ad")]:
        hashes = ph.prompt_block_hashes(tokens, 4, adapter)
        assert raw.match(hashes) == decoded.match(hashes) != {}
    assert (len(raw), raw.blocks("r"), raw.orphans) == (len(decoded), decoded.blocks("r"), 1)
    assert raw.match(ph.prompt_block_hashes(TOKENS, 4)) == {"r": 1}  # block 2 removed


def test_a_malformed_raw_event_changes_nothing():
    index = PrefixIndex()
    index.apply("r", kw.decode_batch_raw_tokens(kw.encode_batch(batch(
        kw.BlockStored([1], None, TOKENS[:4], 4)
    ))).events)  # fmt: skip
    before = (len(index), index.blocks("r"), index.match(ph.prompt_block_hashes(TOKENS, 4)))
    bad = kw.BlockStored([2, 3], 1, [*TOKENS[4:11], -5], 4)
    (event,) = kw.decode_batch_raw_tokens(kw.encode_batch(batch(bad))).events
    with pytest.raises(ValueError, match="token_ids: item 7 is negative \\(-5\\)"):
        index.apply("r", [event])
    assert (len(index), index.blocks("r"), index.match(ph.prompt_block_hashes(TOKENS, 4))) == before


# --- the index's store, compiled (PrefixIndex.stored for raw token_ids) --------------------


def test_store_writes_what_the_python_loop_writes_including_shared_holders():
    # Three replicas, overlapping prefixes (held by one, two, three of them): the engine maps
    # and holder masks built from raw token_ids equal the ones the Python path builds.
    rng = random.Random(3)
    docs = [[rng.randrange(50_000) for _ in range(64)] for _ in range(4)]
    events = {
        f"r{r}": [
            kw.BlockStored([r * 100 + d * 10 + i for i in range(4)], None, docs[d], 16)
            for d in range(4)
            if (d + r) % 3 or d == 0
        ]
        for r in range(3)
    }
    raw, decoded = PrefixIndex(), PrefixIndex()
    for replica, stored in events.items():
        payload = kw.encode_batch(batch(*stored))
        assert raw.apply(replica, kw.decode_batch_raw_tokens(payload).events) == (
            decoded.apply(replica, kw.decode_batch(payload).events)
        )
    assert raw._holders == decoded._holders
    assert raw._engine == decoded._engine
    assert sorted(bin(mask).count("1") for mask in raw._holders.values())[-4:] == [3, 3, 3, 3]
    # One replica's blocks share its cached single-bit int (match_slots relies on it).
    assert all(
        mask is raw._bits[mask.bit_length() - 1]
        for mask in raw._holders.values()
        if mask & (mask - 1) == 0
    )


def test_store_with_fewer_blocks_than_hashes_stores_nothing():
    engine, holders = {}, {}
    raw = msgspec.msgpack.encode(TOKENS[:8])  # 2 blocks of 4, 3 engine hashes
    ours = ph.store_msgpack_blocks(raw, 4, 0, [b"a", b"b", b"c"], engine, holders, 1)
    assert ours == ph.chain_hashes(TOKENS[:8], 4, 0)
    assert engine == {} and holders == {}


def test_store_refuses_bad_input_before_changing_anything():
    engine, holders = {b"x": 1}, {1: 1}
    good = msgspec.msgpack.encode(TOKENS[:8])
    with pytest.raises(ValueError, match="token_ids: item 5 is negative"):
        ph.store_msgpack_blocks(msgspec.msgpack.encode([1, 2, 3, 4, 5, -6, 7, 8]), 4, 0,
                                [b"a", b"b"], engine, holders, 2)  # fmt: skip
    with pytest.raises(TypeError, match="block_hashes must be a list, not tuple"):
        ph.store_msgpack_blocks(good, 4, 0, (b"a", b"b"), engine, holders, 2)
    with pytest.raises(TypeError, match="engine and holders must be dicts"):
        ph.store_msgpack_blocks(good, 4, 0, [b"a", b"b"], engine, [], 2)
    with pytest.raises(TypeError, match="takes 7 arguments \\(3 given\\)"):
        ph.store_msgpack_blocks(good, 4, 0)
    assert engine == {b"x": 1} and holders == {1: 1}
