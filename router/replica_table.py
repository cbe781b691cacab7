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

# Up to this many rows, work on a few rows is done row by row on Python numbers: a numpy call
# on a few elements costs more than the arithmetic (bench/router_cost.py).
FEW_ROWS = 32


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
        # over about share_window() decisions; policies/scorers.py's share gate reads it),
        # kept as share_raw x share_scale so that decaying every share is one multiply of
        # the scale; and the sum of the shares.
        self.share_raw = np.zeros(0, np.float64)
        self.share_scale = 1.0
        self.share_total = 0.0
        # Tokens each replica holds in its KV cache by its own events (the prefix index's
        # blocks x block size), refreshed by the Decider; policies/scorers.py's KvPressure.
        self.held_tokens = np.zeros(0, np.float64)
        # Each replica's KV capacity in tokens as its engine reports it (0: unknown).
        self.kv_capacity = np.zeros(0, np.float64)
        self.unroutable = 0  # how many rows have routable False (filters skip work when 0)
        self.kv_capacity_rows = 0  # how many rows have a KV capacity (kv_capacity > 0)
        self._floor: float | None = None  # load.min(), while known
        self._at_floor = 0  # rows whose load is _floor
        # Rows of batch-pool replicas (Register.role "batch"), fixed at add; and how many.
        self.batch_pool = np.zeros(0, bool)
        self.batch_rows = 0
        # Rows of prefill-pool replicas (Register.role "prefill", policies/pd_roles.py), fixed
        # at add; and how many.
        self.prefill_pool = np.zeros(0, bool)
        self.prefill_rows = 0

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
        "share_raw",
        "held_tokens",
        "kv_capacity",
        "batch_pool",
        "prefill_pool",
    )
    # The share average spans SHARE_WINDOW decisions, or SHARE_WINDOW_PER_REPLICA per
    # replica in a larger fleet: a 32-decision window cannot tell 2% shares apart.
    SHARE_WINDOW = 32
    SHARE_WINDOW_PER_REPLICA = 4

    def share_window(self) -> int:
        return max(self.SHARE_WINDOW, self.SHARE_WINDOW_PER_REPLICA * len(self.replicas))

    @property
    def recent_share(self) -> np.ndarray:
        return self.share_raw * self.share_scale

    def load_floor(self) -> float:
        """The least load of any row (0 with no rows); kept with the number of rows at it
        between changes, rescanned only when the last row at it rose."""
        if self._floor is None:
            if len(self.load) <= FEW_ROWS:
                loads = self.load.tolist()
                self._floor = float(min(loads)) if loads else 0.0
                self._at_floor = loads.count(self._floor)
            else:
                self._floor = float(self.load.min())
                self._at_floor = int((self.load == self._floor).sum())
        return self._floor

    def _set_load(self, row: int, new: float) -> None:
        old = float(self.load[row])
        self.load[row] = new
        floor = self._floor
        if floor is None or new == old:
            return
        if new < floor:
            self._floor, self._at_floor = float(new), 1
            return
        if new == floor:
            self._at_floor += 1
        if old == floor:
            self._at_floor -= 1
            if not self._at_floor:
                self._floor = None

    def add(self, replica: Replica) -> None:
        replica.row = len(self.replicas)
        self.replicas.append(replica)
        for name in self._VECTORS:
            vec = getattr(self, name)
            setattr(self, name, np.append(vec, np.zeros(1, vec.dtype)))
        self.unroutable += 1  # update() counts it back if routable
        self.routable[replica.row] = False
        self._floor = None
        if replica.spec.role == "batch":
            self.batch_pool[replica.row] = True
            self.batch_rows += 1
        elif replica.spec.role == "prefill":
            self.prefill_pool[replica.row] = True
            self.prefill_rows += 1
        self.update(replica)

    def remove(self, replica: Replica) -> None:
        row, last = replica.row, len(self.replicas) - 1
        if not self.routable[row]:
            self.unroutable -= 1
        if self.batch_pool[row]:
            self.batch_rows -= 1
        if self.prefill_pool[row]:
            self.prefill_rows -= 1
        if self.kv_capacity[row] > 0:
            self.kv_capacity_rows -= 1
        self.share_total -= float(self.share_raw[row]) * self.share_scale
        self._floor = None
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
        self._set_load(row, replica.in_flight + replica.load.waiting)

    def note_routed(self, row: int) -> None:
        """A request went to `row`: decay every replica's recent share, add to this one's."""
        step = 1.0 / self.share_window()
        self.share_scale *= 1.0 - step
        self.share_total = self.share_total * (1.0 - step) + step
        self.share_raw[row] += step / self.share_scale
        if self.share_scale < 1e-100:  # fold the scale in before it underflows
            self.share_raw *= self.share_scale
            self.share_scale = 1.0

    def update(self, replica: Replica) -> None:
        row = replica.row
        self.in_flight[row] = replica.in_flight
        self.waiting[row] = replica.load.waiting
        self.running[row] = replica.load.running
        self.kv_usage[row] = replica.load.kv_usage
        self.active_tokens[row] = replica.active_tokens
        self._set_load(row, replica.in_flight + replica.load.waiting)
        self.kv_fill[row] = min(max(replica.load.kv_usage, 0.0), 1.0)
        had = bool(self.kv_capacity[row] > 0)
        self.kv_capacity[row] = replica.load.kv_capacity_tokens
        self.kv_capacity_rows += int(replica.load.kv_capacity_tokens > 0) - int(had)
        if bool(self.routable[row]) != replica.routable:
            self.unroutable += -1 if replica.routable else 1
            self.routable[row] = replica.routable
