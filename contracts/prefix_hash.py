"""Our own chained block hashes of token ids (not vLLM's: those depend on its seed and on
the adapter's path, which events do not carry).

A block's hash covers its tokens and, through the chain, every token before it; the chain
starts from a seed derived from the LoRA adapter name ("" for the base model) and the
cache salt ("" for none; contracts/cache_salt.py), so the same tokens under different
adapters or salts never match. The router computes these from the
`token_ids` of vLLM's BlockStored events; the requester (the gateway) computes the same
from the prompt's tokens: h_i = hash((h_{i-1}, tuple of block i's token ids)), a signed
64-bit int.

Deterministic across processes: Python's hash of a tuple of ints does not depend on
PYTHONHASHSEED (only str and bytes hashes do); the adapter name goes through blake2b.

Compiled: `chain_hashes` and `chain_hashes_msgpack` (from a BlockStored event's raw msgpack
`token_ids`, no Python ints made) come from contracts/_blockhash.c, which reproduces CPython's
tuple and int hashes without building tuples; `chain_hashes_reference` below is the
definition. Importing this module checks the two agree on a fixed sample and refuses to run
when they do not (another interpreter or hash width) or when the extension is not built:
a router whose hashes silently differ from the gateway's would never find a cached prefix.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgspec

from hpcserve.contracts.compiled_extension import load_extension

# contracts/_blockhash.c's BLOCKHASH_API_VERSION is 3.
_blockhash: Any = load_extension("hpcserve.contracts._blockhash", "contracts/_blockhash.c", 3)

HASH_MASK = (1 << 60) - 1


@lru_cache(maxsize=4096)
def chain_seed(adapter: str = "", salt: str = "") -> int:
    """The chain's start for the LoRA adapter `adapter` ("": the base model) and the cache
    salt `salt` ("": none; contracts/cache_salt.py)."""
    name = adapter.encode() + (b"\x00salt:" + salt.encode() if salt else b"")
    digest = hashlib.blake2b(b"hpcserve-prefix:" + name, digest_size=8).digest()
    return int.from_bytes(digest, "big") & HASH_MASK


def chain_hashes_reference(tokens: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Hashes of the full blocks of `tokens`, chained from `parent`; a partial tail is left out.
    The definition; `chain_hashes` computes the same, compiled."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out: list[int] = []
    append, h = out.append, parent
    # zip(*[it] * n) yields the blocks as n-tuples, cut in C; a partial tail is dropped.
    for block in zip(*[iter(tokens)] * block_size, strict=False):
        h = hash((h, block))
        append(h)
    return out


chain_hashes = _blockhash.chain_hashes
"""chain_hashes_reference, compiled: (tokens, block_size, parent) -> list[int]."""

chain_hashes_msgpack = _blockhash.chain_hashes_msgpack
"""(token_ids, block_size, parent, max_blocks=-1) -> list[int]: chain_hashes of a buffer holding
one msgpack array of non-negative ints (a BlockStored event's raw `token_ids`), at most
`max_blocks` blocks; ValueError naming the problem when it is anything else."""

store_msgpack_blocks = _blockhash.store_msgpack_blocks
"""(token_ids, block_size, parent, block_hashes, engine, holders, bit) -> list[int]: the index's
work for one BlockStored event (prefix_index.PrefixIndex.stored), compiled: our hashes of the
event's blocks as chain_hashes_msgpack computes them (ValueError, nothing changed, on bad
token_ids); when there is one per engine hash, engine[block_hash] = ours and each holder mask
OR-ed with `bit`; with fewer, nothing is stored."""

msgpack_array_length = _blockhash.array_length
"""The item count of the msgpack array in a buffer (its header only)."""

holder_mask_run = _blockhash.mask_run
"""(holders, hashes, start, alive) -> int: the prefix index's walk (PrefixIndex.match_slots),
compiled: the first index from `start` whose holder mask drops a bit of `alive`, or
len(hashes); a mask wider than 64 bits that differs from `alive` also stops it."""

note_routed_blocks = _blockhash.note_blocks
"""(recent, holders, hashes, start, expires, bit, renew_before) -> None: RoutedPrefixes.routed's
work, compiled: each hash from `start` not in `recent` OR-ed into its holder mask and recorded
until `expires`; a recorded one expiring before `renew_before` renewed in its place, a later
one left as it is."""


def _check_parity() -> None:
    tokens = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**61 - 1, 2**64 - 1]
    tokens += [(i * 7_919) % 150_000 for i in range(52)]
    raw = msgspec.msgpack.encode(tokens)
    for parent in (0, 1, -1, -2, 2**61 - 1, 2**61, -(2**63), 2**63 - 1, chain_seed("")):
        for block_size in (1, 16, 17):
            want = chain_hashes_reference(tokens, block_size, parent)
            engine: dict = {}
            stored = store_msgpack_blocks(raw, block_size, parent, want[:3], engine, {}, 1)
            if (
                chain_hashes(tokens, block_size, parent) != want
                or chain_hashes_msgpack(raw, block_size, parent) != want
                or stored != want[:3]
                or list(engine.values()) != want[:3]
            ):
                raise RuntimeError(
                    "hpcserve.contracts._blockhash disagrees with "
                    "prefix_hash.chain_hashes_reference "
                    f"(parent {parent}, block_size {block_size}) on {sys.implementation.name} "
                    f"{sys.version.split()[0]}, hash width {sys.hash_info.width}: its tuple hash "
                    "is CPython's (3.8+, 64-bit); run hpcserve on such an interpreter"
                )


_check_parity()


def prompt_block_hashes(
    tokens: Sequence[int], block_size: int, adapter: str = "", salt: str = ""
) -> list[int]:
    return chain_hashes(tokens, block_size, chain_seed(adapter, salt))
