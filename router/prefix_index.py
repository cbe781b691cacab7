"""Which replicas hold which prompt prefixes in their KV cache, kept from vLLM's events.

Two maps:
- ``holders``: our chained block hash (prefix_hash.py) -> bitmask of replica slots whose
  cache holds that block. A block held by one replica shares the slot's cached bit int,
  so the common case costs one dict entry and one 32-byte key.
- per slot, ``engine``: vLLM's block hash (the bytes or int as decoded) -> our hash, the
  only place the engine's hash is used: to find what a BlockRemoved removes and to chain
  a BlockStored onto its parent.

``match`` walks a request's block hashes from the first, AND-ing masks: each replica's
matched depth is where its bit drops out, so a lookup costs one dict get per matched
block, whatever the number of replicas.

Failure modes: a BlockStored whose parent we never saw (events lost before we subscribed,
or the index was reset) cannot be chained and is counted in ``orphans``; the replica looks
colder than it is until those blocks are stored again. Two engine blocks with the same
tokens and adapter but different extra keys (cache salt, multimodal) map to one of our
hashes, and removing either clears it: the replica looks colder, never hotter.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import msgspec

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.cache_salt import salt_of
from hpcserve.contracts.prefix_hash import (
    chain_hashes,
    chain_seed,
    holder_mask_run,
    msgpack_array_length,
    note_routed_blocks,
    store_msgpack_blocks,
)

_BASE_SEED = chain_seed("")


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._bits: list[int] = []
        self._engine: list[dict[bytes | int, int]] = []  # the engine's opaque hash -> ours
        self._block_size: list[int] = []
        # Per slot, blocks the router put there itself (a routed prompt's blocks: approx_index.py)
        # that no BlockStored has confirmed: our hash -> when it expires. Oldest first.
        self._unconfirmed: list[OrderedDict[int, float]] = []
        self._free: list[int] = []
        self.orphans = 0

    # --- replicas -------------------------------------------------------------------
    def slot(self, replica_id: str) -> int:
        slot = self._slot_of.get(replica_id)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self._ids[slot] = replica_id
        else:
            slot = len(self._ids)
            self._ids.append(replica_id)
            self._bits.append(1 << slot)
            self._engine.append({})
            self._block_size.append(0)
            self._unconfirmed.append(OrderedDict())
        self._slot_of[replica_id] = slot
        return slot

    def drop(self, replica_id: str) -> None:
        slot = self._slot_of.pop(replica_id, None)
        if slot is None:
            return
        self._clear_slot(slot)
        self._ids[slot] = None
        self._block_size[slot] = 0
        heapq.heappush(self._free, slot)

    def clear(self, replica_id: str) -> None:
        """Forget every block of a replica (AllBlocksCleared, or its events stopped)."""
        slot = self._slot_of.get(replica_id)
        if slot is not None:
            self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> None:
        for ours in self._engine[slot].values():
            self._discard(slot, ours)
        self._engine[slot] = {}
        for ours in self._unconfirmed[slot]:
            self._discard(slot, ours)
        self._unconfirmed[slot] = OrderedDict()

    # --- events ---------------------------------------------------------------------
    def apply(self, replica_id: str, events: Iterable[kw.KVEvent]) -> tuple[int, int]:
        """Apply one batch of a replica's events; the blocks it stored and removed."""
        slot = self._slot_of.get(replica_id)
        if slot is None:
            slot = self.slot(replica_id)
        stored = removed = 0
        for event in events:
            if isinstance(event, kw.BlockStored):
                self.stored(slot, event)
                stored += len(event.block_hashes)
            elif isinstance(event, kw.BlockRemoved):
                self.removed(slot, event)
                removed += len(event.block_hashes)
            elif isinstance(event, kw.AllBlocksCleared):
                self._clear_slot(slot)
        return stored, removed

    def stored(self, slot: int, event: kw.BlockStored) -> None:
        engine = self._engine[slot]
        parent = event.parent_block_hash
        if parent is None:
            # The cache salt the gateway set is in the first block's extra keys.
            salt = salt_of(event.extra_keys[0], event.lora_name) if event.extra_keys else ""
            h = chain_seed(event.lora_name or "", salt) if event.lora_name or salt else _BASE_SEED
        else:
            parent_hash = engine.get(parent)
            if parent_hash is None:
                self.orphans += 1
                return
            h = parent_hash
        tokens = event.token_ids
        hashes = event.block_hashes
        bit = self._bits[slot]
        n = len(hashes)
        # kv_wire.decode_batch_raw_tokens's events carry the tokens undecoded
        raw = type(tokens) is msgspec.Raw  # type: ignore[comparison-overlap]
        size = event.block_size
        if not size and n:
            size = (msgpack_array_length(tokens) if raw else len(tokens)) // n
        if size <= 0:
            self.orphans += 1
            return
        if raw:
            # Compiled (prefix_hash): hashes, then (only when there is one per engine hash) the
            # engine map and holder masks as in the loop below; ValueError naming the problem,
            # nothing changed, when the tokens are not an array of non-negative ints.
            ours = store_msgpack_blocks(tokens, size, h, hashes, engine, self._holders, bit)
            if len(ours) < n:
                self.orphans += 1
                return
        else:
            ours = chain_hashes(tokens, size, h)
            if len(ours) < n:
                self.orphans += 1
                return
            del ours[n:]
            engine.update(zip(hashes, ours, strict=True))
            holders = self._holders
            setdefault = holders.setdefault
            for h in ours:
                old = setdefault(h, bit)
                if old is not bit:
                    holders[h] = old | bit
        self._block_size[slot] = size
        # Blocks the router recorded when it routed a prompt here are now the engine's.
        pending = self._unconfirmed[slot]
        if pending:
            pop = pending.pop
            for h in ours:
                pop(h, None)

    def removed(self, slot: int, event: kw.BlockRemoved) -> None:
        engine = self._engine[slot]
        for block_hash in event.block_hashes:
            ours = engine.pop(block_hash, None)
            if ours is not None:
                self._discard(slot, ours)

    # --- hashes without events (approximate mode) -----------------------------------
    def unconfirmed(self, slot: int) -> OrderedDict[int, float]:
        """The slot's blocks added by the router and not (yet) stored by an event: our hash ->
        expiry time, oldest first; approx_index.py keeps it, the index empties it as events
        store the blocks and when the slot is cleared or dropped."""
        return self._unconfirmed[slot]

    def slots_with_unconfirmed(self) -> list[int]:
        return [slot for slot, record in enumerate(self._unconfirmed) if record]

    def holds(self, slot: int, h: int) -> bool:
        return bool(self._holders.get(h, 0) & self._bits[slot])

    def note_routed(
        self, slot: int, hashes: list[int], start: int, expires: float, renew_before: float
    ) -> None:
        """The blocks of `hashes` from `start` routed to the slot: each not yet unconfirmed
        there is added to its holders and recorded as unconfirmed until `expires`; a recorded
        one expiring before `renew_before` is renewed to `expires` in its place. Compiled
        (note_routed_blocks)."""
        recent, bit = self._unconfirmed[slot], self._bits[slot]
        note_routed_blocks(recent, self._holders, hashes, start, expires, bit, renew_before)

    def add_hashes(self, slot: int, hashes: Iterable[int]) -> None:
        holders, bit = self._holders, self._bits[slot]
        for h in hashes:
            old = holders.get(h)
            holders[h] = bit if old is None else old | bit

    def discard_hashes(self, slot: int, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._discard(slot, h)

    def _discard(self, slot: int, h: int) -> None:
        holders = self._holders
        mask = holders.get(h)
        if mask is None:
            return
        mask &= ~self._bits[slot]
        if not mask:
            del holders[h]
        elif mask & (mask - 1) == 0:
            holders[h] = self._bits[mask.bit_length() - 1]  # share the cached single-bit int
        else:
            holders[h] = mask

    # --- lookups --------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Replica id -> number of leading blocks of `hashes` in its cache (absent: 0)."""
        ids = self._ids
        slots, depths = self.match_slots(hashes)
        return {ids[slot]: depth for slot, depth in zip(slots, depths, strict=True)}  # type: ignore[misc]

    def match_slots(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Like `match`, by slot: (slots, matched depth of each); the decision's hot path.
        The runs of blocks with the same holders are walked compiled (holder_mask_run);
        this loop sees only where a replica drops out."""
        slots: list[int] = []
        depths: list[int] = []
        if not hashes:
            return slots, depths
        holders = self._holders
        alive = holders.get(hashes[0], 0)
        if not alive:
            return slots, depths
        if type(hashes) is not list:
            hashes = list(hashes)
        n = len(hashes)
        depth = 1
        while True:
            depth = holder_mask_run(holders, hashes, depth, alive)
            if depth >= n:
                break
            still = alive & holders.get(hashes[depth], 0)
            if still != alive:
                lost = alive & ~still
                while lost:
                    low = lost & -lost
                    slots.append(low.bit_length() - 1)
                    depths.append(depth)
                    lost ^= low
                alive = still
                if not alive:
                    return slots, depths
            depth += 1
        while alive:
            low = alive & -alive
            slots.append(low.bit_length() - 1)
            depths.append(depth)
            alive ^= low
        return slots, depths

    def slot_of(self, replica_id: str) -> int | None:
        """The replica's slot, if it has one (`slot` allocates one)."""
        return self._slot_of.get(replica_id)

    @property
    def block_sizes(self) -> list[int]:
        """Each slot's block size as its events gave it (0: none yet); read-only."""
        return self._block_size

    @property
    def slot_ids(self) -> list[str | None]:
        """Each slot's replica id (None: free); read-only."""
        return self._ids

    def replica_of(self, slot: int) -> str | None:
        return self._ids[slot]

    def slot_block_size(self, slot: int) -> int:
        return self._block_size[slot]

    def block_size(self, replica_id: str) -> int:
        """The block size seen in the replica's events (0: none seen yet)."""
        slot = self._slot_of.get(replica_id)
        return 0 if slot is None else self._block_size[slot]

    def blocks(self, replica_id: str) -> int:
        slot = self._slot_of.get(replica_id)
        return 0 if slot is None else len(self._engine[slot])

    def __len__(self) -> int:
        """Distinct block hashes indexed (over all replicas)."""
        return len(self._holders)
