"""A tenant's usage over the last minute, in one-second slots: what each gateway admits
against, and what the router's quota book adds up across gateways."""

from __future__ import annotations

from collections import deque

from hpcserve.contracts import protocol as p

WINDOW_S = 60


class Window:
    """Requests and tokens in one-second slots over the last `WINDOW_S` seconds."""

    __slots__ = ("_slots", "requests", "tokens")

    def __init__(self) -> None:
        self._slots: deque[list[int]] = deque()  # [second, requests, tokens], oldest first
        self.requests = 0
        self.tokens = 0

    def add(self, now: float, requests: int, tokens: int) -> None:
        if not requests and not tokens:
            return
        self.expire(now)
        self._add_at(int(now), requests, tokens)

    def _add_at(self, second: int, requests: int, tokens: int) -> None:
        if self._slots and self._slots[-1][0] >= second:
            slot = self._slots[-1]
            slot[1] += requests
            slot[2] += tokens
        else:
            self._slots.append([second, requests, tokens])
        self.requests += requests
        self.tokens += tokens

    def expire(self, now: float) -> None:
        oldest_kept = int(now) - WINDOW_S + 1
        while self._slots and self._slots[0][0] < oldest_kept:
            _, requests, tokens = self._slots.popleft()
            self.requests -= requests
            self.tokens -= tokens

    def ages(self, now: float) -> list[p.UsageSlot]:
        """The window as it is now: per second, how long ago (oldest first) and its usage."""
        self.expire(now)
        return [p.UsageSlot(round(now - second, 3), r, t) for second, r, t in self._slots]

    @classmethod
    def restored(cls, now: float, slots: list[p.UsageSlot]) -> Window:
        """A window holding `slots` (another clock's `ages`) at their ages from `now`."""
        window = cls()
        for slot in sorted(slots, key=lambda s: -s.age_s):
            second = int(now - max(slot.age_s, 0.0))
            window._add_at(second, slot.requests, slot.tokens)
        window.expire(now)
        return window

    def frees_in_s(self, now: float) -> float:
        """Seconds until the oldest usage in the window leaves it (0 when empty)."""
        self.expire(now)
        if not self._slots:
            return 0.0
        return max(0.0, self._slots[0][0] + WINDOW_S - now)
