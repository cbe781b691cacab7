"""Which routing connection counted each request in flight, so that a lost message cannot
leave a count behind for good.

Releases and InFlight declarations are fire and forget: one lost with a connection (a
network blip; the bytes were in flight when it broke) would leave the router's in-flight
count of a replica too high, or too low, until the router restarts. So the router books
every count under the connection it came by: a Route answered with a replica, or a request
declared by InFlight. When a connection drops, everything booked under it is released, and
the gateway, which saw the same connection drop, declares again on its next connection what
it still has in flight (gateway/routing_client.py). A release only undoes what its own
connection booked: one left over from a dropped connection is ignored.

A half-open connection (the gateway's side gone without a word) keeps its bookings until
the router's side notices (TCP keepalive, contracts/zmtp.py): an overcount for that long.
"""

from __future__ import annotations


class InFlightBook:
    """Counts by connection -> replica -> model asked for ("" when not said)."""

    __slots__ = ("_by_peer",)

    def __init__(self) -> None:
        self._by_peer: dict[bytes, dict[str, dict[str, int]]] = {}

    def booked(self, peer: bytes, replica_id: str, model: str) -> None:
        models = self._by_peer.setdefault(peer, {}).setdefault(replica_id, {})
        models[model] = models.get(model, 0) + 1

    def release(self, peer: bytes, replica_id: str, model: str) -> str | None:
        """The model of a request `peer` booked on the replica, now unbooked: `model` if one
        was booked under it, else any (a gateway that gave up on a Route releases its late
        reply without the model); None when `peer` has none booked there (nothing to
        release)."""
        replicas = self._by_peer.get(peer)
        models = replicas.get(replica_id) if replicas else None
        if not models or replicas is None:
            return None
        if model not in models:
            model = next(iter(models))
        count = models[model]
        if count > 1:
            models[model] = count - 1
        else:
            del models[model]
            if not models:
                del replicas[replica_id]
        return model

    def dropped(self, peer: bytes) -> list[tuple[str, str]]:
        """Everything `peer` had booked, one (replica, model) per request, now forgotten."""
        released = []
        for replica_id, models in self._by_peer.pop(peer, {}).items():
            for model, count in models.items():
                released += [(replica_id, model)] * count
        return released

    def total(self) -> int:
        return sum(sum(m.values()) for r in self._by_peer.values() for m in r.values())
