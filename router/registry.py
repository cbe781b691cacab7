"""The live replica set, kept by leases.

A replica is routable from its Register until it deregisters or its lease lapses
(no heartbeat for `lease_s`). Pure bookkeeping: the caller passes the clock, so
tests drive time by hand and nothing here does I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec

from hpcserve.contracts.protocol import Register, ReplicaInfo, ReplicaLoad
from hpcserve.router import queue_wait
from hpcserve.router.replica_table import ReplicaTable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    spec: Register
    registered_at: float
    last_seen: float
    load: ReplicaLoad
    in_flight: int = 0
    # Prompt tokens of routed, unreleased requests (what they hold of the KV cache).
    active_tokens: int = 0
    # False: out of routing now (unhealthy, draining) though still registered.
    routable: bool = True
    # Its row in its model's ReplicaTable (the policies' vectors).
    row: int = -1
    # Service rate and batch size: its queue wait, for overflow (router/queue_wait.py).
    service: queue_wait.ServiceTracker = field(default_factory=queue_wait.ServiceTracker)
    # Requests routed here since it registered (ReplicaInfo.routed, for autoscaling).
    routed_total: int = 0

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def queued(self) -> int:
        """Requests routed here and not released, plus what the engine reports waiting."""
        return self.in_flight + self.load.waiting

    def info(self, now: float, switch: str = "") -> ReplicaInfo:
        return ReplicaInfo(
            replica_id=self.spec.replica_id,
            model=self.spec.model,
            url=self.spec.url,
            pool=self.spec.pool,
            slurm_job_id=self.spec.slurm_job_id,
            node=self.spec.node,
            age_s=round(now - self.registered_at, 3),
            last_seen_age_s=round(now - self.last_seen, 3),
            in_flight=self.in_flight,
            load=self.load,
            cached=self.spec.cached,
            model_ref=self.spec.model_ref,
            role=self.spec.role,
            routed=self.routed_total,
            switch=switch,
        )


def _same_replica(a: Register, b: Register) -> bool:
    """Equal but for what a live replica reports changing: load, adapters, cache contents."""
    volatile = {"load": ReplicaLoad(), "adapters": [], "cached": []}
    return msgspec.structs.replace(a, **volatile) == msgspec.structs.replace(b, **volatile)


class Registry:
    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self._replicas: dict[str, Replica] = {}
        self._by_model: dict[str, list[Replica]] = {}
        self._tables: dict[str, ReplicaTable] = {}
        # Called with each replica added, and each replica id removed (any reason).
        self.on_add: list[Callable[[Replica], None]] = []
        self.on_remove: list[Callable[[str], None]] = []
        # Completion timing for queue waits (router/queue_wait.py), turned on by the first
        # request with a queue budget: a router without overflow traffic pays nothing.
        self.track_service = False

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._replicas.values())

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def for_model(self, model: str) -> list[Replica]:
        return self._by_model.get(model, [])

    def table(self, model: str) -> ReplicaTable | None:
        return self._tables.get(model)

    def routed(self, replica: Replica, prompt_tokens: int = 0) -> None:
        if self.track_service and not replica.in_flight:
            replica.service.started(queue_wait.clock())
        replica.in_flight += 1
        replica.routed_total += 1
        replica.active_tokens += prompt_tokens
        self._tables[replica.model].count(replica)

    def released(self, replica_id: str) -> None:
        """A routed request finished. Release does not say which one, so the replica's
        active tokens drop by their mean per request (all of them with the last)."""
        replica = self._replicas.get(replica_id)
        if replica is None or replica.in_flight <= 0:
            return
        replica.active_tokens -= replica.active_tokens // replica.in_flight
        replica.in_flight -= 1
        if self.track_service:
            replica.service.finished(queue_wait.clock(), replica.in_flight > 0)
        if not replica.in_flight:
            replica.active_tokens = 0
        self._tables[replica.model].count(replica)

    def set_routable(self, replica_id: str, routable: bool) -> bool:
        """Take a registered replica out of routing (or back); False when unknown."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        replica.routable = routable
        self._tables[replica.model].update(replica)
        return True

    def models(self) -> dict[str, int]:
        return {model: len(replicas) for model, replicas in self._by_model.items()}

    def register(self, msg: Register, now: float) -> Replica:
        old = self._replicas.get(msg.replica_id)
        if old is not None and _same_replica(old.spec, msg):
            # A repeated Register (the agent resends it until acknowledged) renews the lease
            # and refreshes what changes over a replica's life; its KV index stays.
            old.spec = msg
            old.last_seen = now
            old.load = msg.load
            old.service.observed(msg.load)
            self._tables[old.model].update(old)
            return old
        if old is not None:
            self._remove(old)
        replica = Replica(spec=msg, registered_at=now, last_seen=now, load=msg.load)
        replica.service.observed(msg.load)
        self._replicas[msg.replica_id] = replica
        self._by_model.setdefault(msg.model, []).append(replica)
        self._tables.setdefault(msg.model, ReplicaTable()).add(replica)
        for callback in self.on_add:
            callback(replica)
        log.info(
            "replica %s registered: model=%s url=%s job=%s node=%s",
            msg.replica_id,
            msg.model,
            msg.url,
            msg.slurm_job_id or "-",
            msg.node or "-",
        )
        return replica

    def heartbeat(self, replica_id: str, load: ReplicaLoad, now: float) -> bool:
        """Renew a lease; False when the replica is unknown and must register again."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        replica.last_seen = now
        replica.load = load
        replica.service.observed(load)
        self._tables[replica.model].update(replica)
        return True

    def deregister(self, replica_id: str, reason: str) -> bool:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return False
        self._remove(replica)
        log.info("replica %s deregistered: %s", replica_id, reason or "no reason given")
        return True

    def expire(self, now: float) -> list[str]:
        """Drop replicas whose lease lapsed; returns their ids."""
        lapsed = [r for r in self._replicas.values() if now - r.last_seen > self.lease_s]
        for replica in lapsed:
            self._remove(replica)
            log.warning(
                "replica %s lease lapsed: no heartbeat for %.1fs (lease %.1fs)",
                replica.replica_id,
                now - replica.last_seen,
                self.lease_s,
            )
        return [r.replica_id for r in lapsed]

    def _remove(self, replica: Replica) -> None:
        del self._replicas[replica.replica_id]
        siblings = self._by_model[replica.model]
        siblings.remove(replica)
        table = self._tables[replica.model]
        table.remove(replica)
        if not siblings:
            del self._by_model[replica.model]
            del self._tables[replica.model]
        for callback in self.on_remove:
            callback(replica.replica_id)
