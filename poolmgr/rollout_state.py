"""The rollouts' state: one JSON file in the state dir, shared by the pool manager's rollout
loop and `hpcserve rollout`.

Every change is a read-modify-write under an exclusive lock (`rollouts.lock`, flock), so
the loop and an admin's command never undo each other; the file is replaced atomically
(temp file + rename), so a reader never sees half of it and a crash leaves the last whole
state. A pool manager that restarts reads it and goes on from the step it was in.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec

from hpcserve.poolmgr.rollout import Rollout
from hpcserve.poolmgr.state_files import write_atomic

ROLLOUTS_FILE = "rollouts.json"
LOCK_FILE = "rollouts.lock"


class RolloutFile(msgspec.Struct):
    rollouts: dict[str, Rollout] = {}  # by alias: the active one, else the last finished


class RolloutStateError(RuntimeError):
    pass


class RolloutBook:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / ROLLOUTS_FILE
        self.lock_path = Path(state_dir) / LOCK_FILE

    def read(self) -> dict[str, Rollout]:
        """The rollouts now, without the lock (a consistent snapshot all the same)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            return msgspec.json.decode(data, type=RolloutFile).rollouts
        except msgspec.DecodeError as err:
            raise RolloutStateError(f"{self.path}: not a rollout state file: {err}") from None

    @contextlib.contextmanager
    def change(self) -> Iterator[dict[str, Rollout]]:
        """The rollouts under the lock; what the block leaves in the dict is written back
        (only if it changed), unless it raises."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            rollouts = self.read()
            before = dict(rollouts)
            yield rollouts
            if rollouts != before:
                encoded = msgspec.json.encode(RolloutFile(rollouts))
                write_atomic(self.path, msgspec.json.format(encoded))
        finally:
            os.close(fd)  # releases the lock
