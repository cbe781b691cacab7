"""Paged KV cache with prefix caching and LRU eviction, as vLLM v1's block pool keeps it.

The cache is ``num_blocks`` blocks of ``block_size`` tokens. A request holds a list of
blocks covering its computed tokens; every *full* block is hashed from its parent's hash
and its token ids (a chain, so equal hashes mean equal prefixes) and kept in a hash table.
A block nobody references goes to the free queue but keeps its hash: a later request with
the same prefix takes it back (a prefix-cache hit) until the block is reused for other
tokens (evicted). Allocation pops the free queue's head, so the block freed longest ago is
evicted first; a finished request frees its blocks last-block-first, so its prefix outlives
its tail, as in vLLM.

Events, as vLLM publishes them: a block that becomes full and gets its hash is
``Stored`` (with its parent's hash and its token ids); a hashed block that is evicted is
``Removed``. A cache hit produces no event. Hashes are 32-byte SHA-256 digests, vLLM's
default; their values are opaque to consumers, only equality and parent links matter.

Failure mode: none by design; ``allocate`` returns False when the free blocks (evictable
ones included) cannot cover a request, and the scheduler then preempts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

ROOT_HASH = hashlib.sha256(b"hpcserve-sim-root").digest()


def block_hash(
    parent: bytes | None, token_ids: list[int] | tuple[int, ...], salt: str = ""
) -> bytes:
    """SHA-256 over the parent's hash and the block's token ids; a first block's (no parent)
    over the request's cache salt too, as vLLM hashes it into the first block alone."""
    h = hashlib.sha256(parent or (_salted_root(salt) if salt else ROOT_HASH))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return h.digest()


def _salted_root(salt: str) -> bytes:
    return hashlib.sha256(ROOT_HASH + salt.encode()).digest()


@dataclass(frozen=True)
class Stored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    # The cache salt of the request whose first block opens this run (no parent), as vLLM
    # publishes it in the first block's extra keys; "" otherwise.
    salt: str = ""


@dataclass(frozen=True)
class Removed:
    block_hashes: list[bytes]


@dataclass(frozen=True)
class Cleared:
    pass


KVEvent = Stored | Removed | Cleared


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None


@dataclass
class SeqBlocks:
    """The blocks one request holds, and how many of them are hashed (full and cached)."""

    blocks: list[int] = field(default_factory=list)
    hashed: int = 0
    last_hash: bytes | None = None  # hash of block ``hashed - 1``: the parent of the next
    salt: str = ""  # the request's cache salt (its first block's hash covers it)


class KVCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"KV cache needs blocks >= 1 and block_size >= 1, got "
                f"{num_blocks} blocks of {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Blocks are made on first use (a big GPU has millions); never-used ones sit at the
        # head of vLLM's free queue, so they are taken before any freed (cached) block.
        self._blocks: dict[int, _Block] = {}
        self._fresh = 0  # blocks [_fresh, num_blocks) were never used
        # Used blocks nobody references, least recently freed first (the eviction order).
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self._seqs: dict[str, SeqBlocks] = {}
        self.events: list[KVEvent] = []
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)

    # -- queries ----------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks in use by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.free_blocks / self.num_blocks

    def holds(self, request_id: str) -> bool:
        return request_id in self._seqs

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._seqs[request_id].blocks) if request_id in self._seqs else []

    def cached_prefix_blocks(self, token_ids: list[int], salt: str = "") -> list[int]:
        """Cached blocks matching the longest prefix of ``token_ids`` (under the cache salt
        ``salt``), leaving at least the last token to compute (a request must run one step
        to produce its first token)."""
        bs = self.block_size
        full = (len(token_ids) - 1) // bs
        found: list[int] = []
        parent: bytes | None = None
        for i in range(full):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs], salt)
            block_id = self._cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
            parent = h
        return found

    # -- changes ----------------------------------------------------------------------------

    def lookup(self, request_id: str, token_ids: list[int], salt: str = "") -> int:
        """Start ``request_id`` on the cached prefix of ``token_ids`` (under its cache salt
        ``salt``): the blocks are taken (referenced), the query counted; returns the number
        of cached tokens."""
        assert request_id not in self._seqs, request_id
        found = self.cached_prefix_blocks(token_ids, salt)
        for block_id in found:
            self._ref(block_id)
        last = self._blocks[found[-1]].hash if found else None
        self._seqs[request_id] = SeqBlocks(found, hashed=len(found), last_hash=last, salt=salt)
        self.queries += len(token_ids)
        self.hits += len(found) * self.block_size
        return len(found) * self.block_size

    def allocate(self, request_id: str, total_tokens: int) -> bool:
        """Make ``request_id`` hold enough blocks for ``total_tokens``; False (and nothing
        changed) when the free queue is too short."""
        seq = self._seqs.setdefault(request_id, SeqBlocks())
        need = -(-total_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        for _ in range(need):
            if self._fresh < self.num_blocks:
                block = self._blocks[self._fresh] = _Block(self._fresh, ref_cnt=1)
                self._fresh += 1
                seq.blocks.append(block.block_id)
                continue
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.hash is not None:
                del self._cached[block.hash]
                self.events.append(Removed([block.hash]))
                block.hash = None
            block.ref_cnt = 1
            seq.blocks.append(block_id)
        return True

    def commit(self, request_id: str, token_ids: list[int], computed: int) -> None:
        """Hash the blocks that ``computed`` tokens of ``token_ids`` fill, and store them.

        A block whose hash another block already has (two requests computed the same prefix
        at once) stays unhashed and is freed as plain space, as vLLM does; each unbroken run
        of newly stored blocks is one ``Stored`` event with the hash before it as parent.
        """
        seq = self._seqs[request_id]
        bs = self.block_size
        full = min(computed // bs, len(seq.blocks))
        if full <= seq.hashed:
            return
        parent = seq.last_hash
        run: list[bytes] = []
        run_parent, run_start = parent, seq.hashed
        for i in range(seq.hashed, full):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs], seq.salt)
            block = self._blocks[seq.blocks[i]]
            if h in self._cached:
                self._flush(run, run_parent, token_ids, run_start, seq.salt)
                run, run_parent, run_start = [], h, i + 1
            else:
                block.hash = h
                self._cached[h] = block.block_id
                run.append(h)
            parent = h
        self._flush(run, run_parent, token_ids, run_start, seq.salt)
        seq.hashed, seq.last_hash = full, parent

    def _flush(
        self,
        run: list[bytes],
        parent: bytes | None,
        token_ids: list[int],
        start: int,
        salt: str = "",
    ) -> None:
        if run:
            bs = self.block_size
            tokens = list(token_ids[start * bs : (start + len(run)) * bs])
            self.events.append(Stored(run, parent, tokens, bs, salt if parent is None else ""))

    def free(self, request_id: str) -> None:
        """Release a request's blocks, last block first (its tail is evicted before its prefix)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        for block_id in reversed(seq.blocks):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's /reset_prefix_cache); False while blocks are held."""
        if self.free_blocks != self.num_blocks:
            return False
        for block in self._blocks.values():
            block.hash = None
        self._cached.clear()
        self.events.append(Cleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1
