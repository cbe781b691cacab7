"""One model's replicas as numpy vectors, so a policy scores 1,000 replicas in microseconds.

Row i of every vector is ``replicas[i]``; the registry keeps both in step (``update``
after every change of a replica's load, in-flight count or routability). Removal moves the
last row into the hole, so rows stay dense.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hpcserve.router.registry import Replica


class ReplicaTable:
    def __init__(self) -> None:
        self.replicas: list[Replica] = []
        self.in_flight = np.zeros(0, np.int64)
        self.waiting = np.zeros(0, np.int64)
        self.running = np.zeros(0, np.int64)
        self.kv_usage = np.zeros(0, np.float64)
        self.active_tokens = np.zeros(0, np.int64)
        self.routable = np.zeros(0, bool)
        # Derived: in_flight + waiting, and KV usage clipped to [0, 1].
        self.load = np.zeros(0, np.float64)
        self.kv_fill = np.zeros(0, np.float64)
        # Each replica's share of the model's recent requests (an exponential moving average
        # over about SHARE_WINDOW decisions; policies/scorers.py's share gate reads it).
        self.recent_share = np.zeros(0, np.float64)
        # Tokens each replica holds in its KV cache by its own events (the prefix index's
        # blocks x block size), refreshed by the Decider; policies/scorers.py's KvPressure.
        self.held_tokens = np.zeros(0, np.float64)
        # Each replica's KV capacity in tokens as its engine reports it (0: unknown).
        self.kv_capacity = np.zeros(0, np.float64)
        self.unroutable = 0  # how many rows have routable False (filters skip work when 0)

    def __len__(self) -> int:
        return len(self.replicas)

    _VECTORS = (
        "in_flight",
        "waiting",
        "running",
        "kv_usage",
        "active_tokens",
        "routable",
        "load",
        "kv_fill",
        "recent_share",
        "held_tokens",
        "kv_capacity",
    )
    SHARE_WINDOW = 32

    def add(self, replica: Replica) -> None:
        replica.row = len(self.replicas)
        self.replicas.append(replica)
        for name in self._VECTORS:
            vec = getattr(self, name)
            setattr(self, name, np.append(vec, np.zeros(1, vec.dtype)))
        self.unroutable += 1  # update() counts it back if routable
        self.routable[replica.row] = False
        self.update(replica)

    def remove(self, replica: Replica) -> None:
        row, last = replica.row, len(self.replicas) - 1
        if not self.routable[row]:
            self.unroutable -= 1
        moved = self.replicas[last]
        self.replicas[row] = moved
        self.replicas.pop()
        for name in self._VECTORS:
            vec = getattr(self, name)
            vec[row] = vec[last]
            setattr(self, name, vec[:last].copy())
        moved.row = row if moved is not replica else -1
        replica.row = -1

    def count(self, replica: Replica) -> None:
        """Only the in-flight count and routed tokens changed (a route or a release)."""
        row = replica.row
        self.in_flight[row] = replica.in_flight
        self.active_tokens[row] = replica.active_tokens
        self.load[row] = replica.in_flight + replica.load.waiting

    def note_routed(self, row: int) -> None:
        """A request went to `row`: decay every replica's recent share, add to this one's."""
        share = self.recent_share
        share *= 1.0 - 1.0 / self.SHARE_WINDOW
        share[row] += 1.0 / self.SHARE_WINDOW

    def update(self, replica: Replica) -> None:
        row = replica.row
        self.in_flight[row] = replica.in_flight
        self.waiting[row] = replica.load.waiting
        self.running[row] = replica.load.running
        self.kv_usage[row] = replica.load.kv_usage
        self.active_tokens[row] = replica.active_tokens
        self.load[row] = replica.in_flight + replica.load.waiting
        self.kv_fill[row] = min(max(replica.load.kv_usage, 0.0), 1.0)
        self.kv_capacity[row] = replica.load.kv_capacity_tokens
        if bool(self.routable[row]) != replica.routable:
            self.unroutable += -1 if replica.routable else 1
            self.routable[row] = replica.routable
