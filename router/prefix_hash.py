"""Our own chained block hashes of token ids (not vLLM's: those depend on its seed and on
the adapter's path, which events do not carry).

A block's hash covers its tokens and, through the chain, every token before it; the chain
starts from a seed derived from the LoRA adapter name ("" for the base model), so the same
tokens under different adapters never match. The router computes these from the
`token_ids` of vLLM's BlockStored events; the requester (the gateway) computes the same
from the prompt's tokens: h_i = hash((h_{i-1}, tuple of block i's token ids)), a signed
64-bit int.

Deterministic across processes: Python's hash of a tuple of ints does not depend on
PYTHONHASHSEED (only str and bytes hashes do); the adapter name goes through blake2b.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

HASH_MASK = (1 << 60) - 1


@lru_cache(maxsize=4096)
def chain_seed(adapter: str = "") -> int:
    digest = hashlib.blake2b(b"hpcserve-prefix:" + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & HASH_MASK


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Hashes of the full blocks of `tokens`, chained from `parent`; a partial tail is left out."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out: list[int] = []
    append, h = out.append, parent
    # zip(*[it] * n) yields the blocks as n-tuples, cut in C; a partial tail is dropped.
    for block in zip(*[iter(tokens)] * block_size, strict=False):
        h = hash((h, block))
        append(h)
    return out


def prompt_block_hashes(tokens: Sequence[int], block_size: int, adapter: str = "") -> list[int]:
    return chain_hashes(tokens, block_size, chain_seed(adapter))
