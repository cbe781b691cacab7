"""A tenant's batch tokens per minute (`batch_tokens_per_min`), in this gateway process.

A token bucket holding at most a minute's tokens, refilled continuously. A request may
start while the bucket is above zero and is charged its real usage when it ends, so the
bucket can go negative: the long-run rate holds without knowing a request's cost up front.
Zero means unlimited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class TokenRate:
    def __init__(self, per_min: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_min = per_min
        self._clock = clock
        self._level = float(per_min)
        self._at = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._level = min(float(self.per_min), self._level + (now - self._at) * self.per_min / 60)
        self._at = now
        return self._level

    def wait_s(self) -> float:
        """Seconds until a request may start (0: now)."""
        if not self.per_min:
            return 0.0
        level = self._refill()
        return 0.0 if level > 0 else (1 - level) * 60 / self.per_min

    def charge(self, tokens: int) -> None:
        if self.per_min:
            self._refill()
            self._level -= tokens

    async def admit(self) -> None:
        while (delay := self.wait_s()) > 0:
            await asyncio.sleep(delay)
