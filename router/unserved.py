"""Demand the router could not serve: per model name, when a Route last found no replica.

A pool scaled to zero (pools[].autoscale.min = 0) has no replica; the gateway holds a request
for it and asks again, and every such Route is recorded here. The pool manager reads the ages
in its one ListReplicas per poll (ReplicaList.unserved) and wakes the pool. Names come from
clients, so the book is bounded: entries older than `keep_s` go, and past `max_models` the
oldest does.

A name the router resolves is recorded as what it resolves to as well (router/server.py):
an alias whose replicas were found but none could take the request, under the served name
it routes to; an alias or a LoRA adapter with no replica at all, in a second book under the
registry version it resolves to (the alias's drawn version, the adapter's base version),
which the pool manager maps to the pool serving that version (ReplicaList.unserved_refs).
"""

from __future__ import annotations


class UnservedModels:
    def __init__(self, keep_s: float = 3600.0, max_models: int = 1024) -> None:
        self.keep_s = keep_s
        self.max_models = max_models
        self._last: dict[str, float] = {}  # model -> the router's clock at its last miss

    def missed(self, model: str, now: float) -> None:
        self._last.pop(model, None)  # re-inserted last: the dict stays oldest first
        self._last[model] = now
        if len(self._last) > self.max_models:
            del self._last[next(iter(self._last))]

    def ages(self, now: float) -> dict[str, float]:
        """Model -> seconds since its last miss, for the misses within `keep_s`."""
        for model in [m for m, at in self._last.items() if now - at > self.keep_s]:
            del self._last[model]
        return {m: round(now - at, 3) for m, at in self._last.items()}
