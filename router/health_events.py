"""The router's record of health findings, kept for the pool manager (pure bookkeeping).

Each finding an engine reports gets a sequence number. The pool manager asks with the
highest number it has acted on (and the log's epoch, which changes when the router
restarts and numbering starts again); the log forgets what was acknowledged and answers
with the rest. Bounded: beyond `limit` the oldest are dropped (and counted).
"""

from __future__ import annotations

import uuid
from collections import deque

from hpcserve.contracts.protocol import HealthEvent, HealthReport


class HealthEventLog:
    def __init__(self, limit: int = 1000) -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self._events: deque[HealthEvent] = deque()
        self._seq = 0
        self.limit = limit
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    def add(self, report: HealthReport, at: float) -> list[HealthEvent]:
        added = []
        for finding in report.findings:
            self._seq += 1
            event = HealthEvent(
                seq=self._seq,
                at=at,
                replica_id=report.replica_id,
                node=report.node,
                slurm_job_id=report.slurm_job_id,
                pool=report.pool,
                finding=finding,
            )
            self._events.append(event)
            added.append(event)
        while len(self._events) > self.limit:
            self._events.popleft()
            self.dropped += 1
        return added

    def since(self, epoch: str, ack_seq: int) -> list[HealthEvent]:
        """Forget what the reader acknowledged (in this epoch); the rest, oldest first."""
        if epoch == self.epoch:
            while self._events and self._events[0].seq <= ack_seq:
                self._events.popleft()
        return list(self._events)
