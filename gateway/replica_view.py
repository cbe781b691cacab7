"""The last replica set the router listed, for routing while the router is away.

Every `gateway.replica_view_s` the routing client asks the router for its replicas. When the
router stops answering (restart, network), requests go to the replicas of this last known
set, least loaded by this gateway's own count, until the router answers again; no prefix
awareness meanwhile. A set older than `max_age_s` is not trusted: then 503 as before.
Aliases route to the replicas serving their target version (the router's last alias map;
no canary split meanwhile), under the name those replicas serve, as the router would answer.
A replica that has died since is found by the request itself (failover retries once
elsewhere, `Route.exclude`).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from hpcserve.contracts import protocol as p

log = logging.getLogger(__name__)


class ReplicaView:
    def __init__(
        self,
        max_age_s: float,
        clock: Callable[[], float],
        rng: random.Random | None = None,
    ) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._by_model: dict[str, list[tuple[str, str]]] = {}
        self._aliases: dict[str, str] = {}  # alias -> the version it routes to
        # version (name@version) -> (replica id, url, served model name) of its replicas
        self._by_ref: dict[str, list[tuple[str, str, str]]] = {}
        self._ref_of: dict[str, str] = {}  # replica id -> the version it serves
        self._updated_at: float | None = None
        self._in_flight: dict[str, int] = {}
        self.router_away = False

    def update(
        self, replicas: Iterable[p.ReplicaInfo], aliases: Mapping[str, str] | None = None
    ) -> None:
        by_model: dict[str, list[tuple[str, str]]] = {}
        by_ref: dict[str, list[tuple[str, str, str]]] = {}
        ref_of: dict[str, str] = {}
        for r in replicas:
            by_model.setdefault(r.model, []).append((r.replica_id, r.url))
            if r.model_ref:
                by_ref.setdefault(r.model_ref, []).append((r.replica_id, r.url, r.model))
                ref_of[r.replica_id] = r.model_ref
        self._by_model, self._by_ref, self._ref_of = by_model, by_ref, ref_of
        self._aliases = dict(aliases or {})
        self._updated_at = self._clock()
        if self.router_away:
            log.info("router answers again: routing by the router")
            self.router_away = False
            self._in_flight.clear()

    def router_lost(self, why: str) -> None:
        if not self.router_away:
            age = self.age_s()
            log.warning(
                "router unavailable (%s): routing on the last known replica set (%s)",
                why,
                "none known" if age is None else f"{age:.1f}s old",
            )
            self.router_away = True

    def age_s(self) -> float | None:
        return None if self._updated_at is None else self._clock() - self._updated_at

    def served_as(self, model: str) -> str:
        """The name the replicas serve `model` under: itself, or for an alias the served name
        of the replicas serving its target version (the most of them)."""
        if model in self._by_model or model not in self._aliases:
            return model
        serving = Counter(served for _, _, served in self._by_ref.get(self._aliases[model], ()))
        return serving.most_common(1)[0][0] if serving else model

    def replicas_of(self, model: str) -> int | None:
        """How many replicas the last set lists for `model` (an alias: its target version's);
        None when no set, or none younger than `max_age_s`, is known."""
        age = self.age_s()
        if age is None or age > self.max_age_s:
            return None
        if model in self._by_model or model not in self._aliases:
            return len(self._by_model.get(model, ()))
        return len(self._by_ref.get(self._aliases[model], ()))

    def pick(self, model: str, exclude: Iterable[str] = ()) -> p.RouteReply | None:
        """A replica of the last known set for `model` (or the alias `model`), least loaded
        by this gateway."""
        age = self.age_s()
        if age is None or age > self.max_age_s:
            return None
        skip = set(exclude)
        served = ""
        if model in self._by_model or model not in self._aliases:
            known = [(rid, url, "") for rid, url in self._by_model.get(model, ())]
        else:
            served = self.served_as(model)
            known = [r for r in self._by_ref.get(self._aliases[model], ()) if r[2] == served]
        candidates = [r for r in known if r[0] not in skip]
        if not candidates:
            return None
        lowest = min(self._in_flight.get(r[0], 0) for r in candidates)
        replica_id, url, served = self._rng.choice(
            [r for r in candidates if self._in_flight.get(r[0], 0) == lowest]
        )
        self._in_flight[replica_id] = lowest + 1
        ref = self._ref_of.get(replica_id, "")
        return p.RouteReply(0, replica_id, url, model=served, model_ref=ref)

    def released(self, replica_id: str) -> None:
        count = self._in_flight.get(replica_id)
        if count is not None:
            if count <= 1:
                del self._in_flight[replica_id]
            else:
                self._in_flight[replica_id] = count - 1
