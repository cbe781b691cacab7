"""Routing policy of the walking skeleton: least load, random among equals.

Load is what the router knows first-hand (requests it routed that have not been
released) plus what the engine last reported as waiting. Ties are broken at
random, so cold replicas at low concurrency share the traffic instead of the
first one in the list taking all of it. Issue 4 replaces this with
filter -> weighted scorers -> picker and KV-cache awareness.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hpcserve.router.registry import Replica


def load_of(replica: Replica) -> int:
    return replica.in_flight + replica.load.waiting


class LeastLoad:
    name = "least-load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[Replica]) -> Replica | None:
        if not candidates:
            return None
        lowest = min(load_of(r) for r in candidates)
        best = [r for r in candidates if load_of(r) == lowest]
        return best[0] if len(best) == 1 else self._rng.choice(best)
