"""Session affinity: requests with the same session key go to the same replica while it
is routable and not overloaded; entries expire after `ttl_s`, at most `max_sessions`."""

from __future__ import annotations

from collections import OrderedDict


class SessionAffinity:
    def __init__(self, ttl_s: float, max_sessions: int) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._where: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def lookup(self, key: str, now: float) -> str | None:
        entry = self._where.get(key)
        if entry is None:
            return None
        replica_id, at = entry
        if now - at > self.ttl_s:
            del self._where[key]
            return None
        return replica_id

    def remember(self, key: str, replica_id: str, now: float) -> None:
        self._where[key] = (replica_id, now)
        self._where.move_to_end(key)
        while len(self._where) > self.max_sessions:
            self._where.popitem(last=False)
