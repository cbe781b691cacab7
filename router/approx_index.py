"""Blocks the router puts in the index itself: the prompt blocks it routed to a replica,
treated as cached there until an event confirms them or a TTL passes, at most `max_blocks`
per replica (oldest forgotten first). Feeds the same PrefixIndex, so the policies do not
know the difference.

Two uses, one mechanism:
- approximate mode, for engines that publish no KV events: what was routed where is all
  the router knows (`ttl_s`, long);
- pending blocks, for engines that do: a prompt's blocks are not stored until its prefill
  has run, so without them the next request of the same customer, arriving meanwhile, sees
  no cache anywhere and starts a second full prefill elsewhere. They are recorded for
  `pending_ttl_s`; the BlockStored events take them over (PrefixIndex.stored empties the
  record), and only blocks no event confirmed expire.

Failure mode: a block believed cached until the TTL although the engine evicted it or never
stored it (a request aborted); a short TTL and a bound below the engine's capacity keep that
small. Blocks of the prefix the replica was found holding are not recorded, so an expiry
does not remove what an event stored there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hpcserve.router.prefix_index import PrefixIndex

RENEW_SLACK = 0.125  # of the TTL: a recorded block with more left is not renewed


class RoutedPrefixes:
    def __init__(self, index: PrefixIndex, ttl_s: float, max_blocks: int) -> None:
        self.index = index
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks

    def blocks(self, replica_id: str) -> int:
        slot = self.index.slot_of(replica_id)
        return 0 if slot is None else len(self.index.unconfirmed(slot))

    def routed(
        self,
        replica_id: str,
        hashes: Sequence[int],
        now: float,
        *,
        ttl_s: float | None = None,
        skip: int = 0,
    ) -> None:
        """`hashes` were routed to the replica: each block past the first `skip` (the prefix
        the caller found it holding) is recorded for `ttl_s` (default: the approximate
        mode's), a recorded one renewed. Blocks past a replica's matched prefix are taken as
        not held: one it held anyway could not extend a match (the walk stops at the gap)."""
        if skip >= len(hashes):
            return
        slot = self.index.slot(replica_id)
        # A renewed block keeps its place: the order is only the expiry scan's (and the
        # bound's) and a renewed block stops the scan at worst until it expires itself.
        # One with more than RENEW_SLACK of its TTL left is not renewed, so a hot prefix is
        # not rewritten on every request: a block lives 7/8 of its TTL to all of it after
        # the last request that routed it.
        ttl = self.ttl_s if ttl_s is None else ttl_s
        expires = now + ttl
        hashes = hashes if type(hashes) is list else list(hashes)
        self.index.note_routed(slot, hashes, skip, expires, expires - ttl * RENEW_SLACK)
        self._expire(self.index.unconfirmed(slot), slot, now)

    def expire(self, now: float) -> None:
        """Forget every replica's expired blocks (a replica that gets no request meanwhile
        would otherwise keep them)."""
        for slot in self.index.slots_with_unconfirmed():
            self._expire(self.index.unconfirmed(slot), slot, now)

    def _expire(self, recent: OrderedDict[int, float], slot: int, now: float) -> None:
        gone = []
        while recent:
            h, expires = next(iter(recent.items()))
            if len(recent) <= self.max_blocks and expires > now:
                break
            recent.popitem(last=False)
            gone.append(h)
        self.index.discard_hashes(slot, gone)
