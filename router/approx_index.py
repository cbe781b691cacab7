"""Approximate mode, for engines that publish no KV events: remember which prompt blocks
were routed to which replica, and treat them as cached there for `ttl_s`, at most
`max_blocks` per replica (oldest forgotten first). Feeds the same PrefixIndex, so the
policies do not know the difference.

Failure mode: it believes a block is cached until the TTL although the engine may have
evicted it sooner; a short TTL and a bound below the engine's capacity keep that small.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hpcserve.router.prefix_index import PrefixIndex


class RoutedPrefixes:
    def __init__(self, index: PrefixIndex, ttl_s: float, max_blocks: int) -> None:
        self.index = index
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._recent: dict[str, OrderedDict[int, float]] = {}

    def blocks(self, replica_id: str) -> int:
        return len(self._recent.get(replica_id, ()))

    def routed(self, replica_id: str, hashes: Sequence[int], now: float) -> None:
        recent = self._recent.setdefault(replica_id, OrderedDict())
        slot = self.index.slot(replica_id)
        fresh = [h for h in hashes if h not in recent]
        for h in hashes:
            recent[h] = now
            recent.move_to_end(h)
        self.index.add_hashes(slot, fresh)
        self._expire(replica_id, recent, slot, now)

    def expire(self, now: float) -> None:
        for replica_id, recent in list(self._recent.items()):
            self._expire(replica_id, recent, self.index.slot(replica_id), now)

    def _expire(self, replica_id: str, recent: OrderedDict[int, float], slot: int, now: float):
        gone = []
        while recent:
            h, at = next(iter(recent.items()))
            if len(recent) <= self.max_blocks and now - at <= self.ttl_s:
                break
            recent.popitem(last=False)
            gone.append(h)
        self.index.discard_hashes(slot, gone)

    def drop(self, replica_id: str) -> None:
        self._recent.pop(replica_id, None)
