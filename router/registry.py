"""The live replica set, kept by leases.

A replica is routable from its Register until it deregisters or its lease lapses
(no heartbeat for `lease_s`). Pure bookkeeping: the caller passes the clock, so
tests drive time by hand and nothing here does I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from hpcserve.router.protocol import Register, ReplicaInfo, ReplicaLoad

log = logging.getLogger(__name__)


@dataclass
class Replica:
    spec: Register
    registered_at: float
    last_seen: float
    load: ReplicaLoad
    in_flight: int = 0

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def model(self) -> str:
        return self.spec.model

    def info(self, now: float) -> ReplicaInfo:
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
        )


class Registry:
    def __init__(self, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self._replicas: dict[str, Replica] = {}
        self._by_model: dict[str, list[Replica]] = {}

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._replicas.values())

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def for_model(self, model: str) -> list[Replica]:
        return self._by_model.get(model, [])

    def models(self) -> dict[str, int]:
        return {model: len(replicas) for model, replicas in self._by_model.items()}

    def register(self, msg: Register, now: float) -> Replica:
        old = self._replicas.get(msg.replica_id)
        if old is not None and old.spec == msg:
            old.last_seen = now
            old.load = msg.load
            return old
        if old is not None:
            self._remove(old)
        replica = Replica(spec=msg, registered_at=now, last_seen=now, load=msg.load)
        self._replicas[msg.replica_id] = replica
        self._by_model.setdefault(msg.model, []).append(replica)
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
        if not siblings:
            del self._by_model[replica.model]
