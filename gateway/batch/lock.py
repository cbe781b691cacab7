"""Who runs batches: the one process holding flock(<batch dir>/runner.lock).

Two lock files under the batch directory, both plain flock(2), so the kernel frees them
when their holder dies (SIGKILL included) and nothing is left to clean up:

  runner.lock      exclusive: its holder runs every active batch; it writes who it is into
                   the file (read by `hpcserve batches` and by the others' log lines)
  runner.present   shared, held by every `hpcserve batch-runner` process for its whole life:
                   "a dedicated runner is here"; a gateway tests it by trying it exclusively

Roles (`batch.runner` for gateways; `hpcserve batch-runner` is always "process"):

  process   takes runner.lock whenever it is free (a second runner process waits, a hot
            standby)
  standby   a gateway that takes runner.lock only while no runner process is present, and
            hands it back (after its requests in flight are stored) once one appears
  gateway   a gateway that takes runner.lock whenever it is free, as a runner process does
  never     a gateway of batch.runner = "process": serves the Batch API, never runs batches

Failure mode: a test of the lock (`holder`, `runner_present`) takes it for an instant; a
runner trying at that instant fails and tries again at its next pass (a second later).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path
from typing import Literal

LockRole = Literal["process", "standby", "gateway", "never"]
LOCK_FILE = "runner.lock"
PRESENT_FILE = "runner.present"


def _try_flock(path: Path, kind: int) -> int | None:
    """An open fd holding the lock, or None when someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _free_now(path: Path) -> bool:
    fd = _try_flock(path, fcntl.LOCK_EX)
    if fd is None:
        return False
    os.close(fd)  # releases it
    return True


def read_holder(root: Path) -> str:
    """Who wrote itself into the lock file last ("" if no one ever did); only meaningful
    while the lock is held (see `RunnerLock.holder`)."""
    try:
        return (root / LOCK_FILE).read_text().strip()
    except OSError:
        return ""


class RunnerLock:
    def __init__(self, root: Path, role: LockRole, *, name: str) -> None:
        self.root = Path(root)
        self.role = role
        self.identity = f"{name} pid {os.getpid()} on {socket.gethostname()}"
        self._fd: int | None = None
        self._present_fd: int | None = None
        self._present_seen = 0
        self.path = self.root / LOCK_FILE

    @property
    def held(self) -> bool:
        return self._fd is not None

    def announce(self) -> bool:
        """A runner process: hold runner.present (shared) for life; False until it could."""
        if self._present_fd is None:
            self._present_fd = _try_flock(self.root / PRESENT_FILE, fcntl.LOCK_SH)
        return self._present_fd is not None

    def runner_present(self) -> bool:
        """A runner process other than this one is up (its shared lock is held)."""
        if self._present_fd is not None:
            return True
        return not _free_now(self.root / PRESENT_FILE)

    def should_hand_back(self) -> bool:
        """A standby gateway holding the lock, with a runner process present at two calls
        in a row (another gateway testing runner.present at one instant looks like one)."""
        if self.role != "standby" or not self.held:
            return False
        self._present_seen = self._present_seen + 1 if self.runner_present() else 0
        return self._present_seen >= 2

    def try_take(self) -> bool:
        """Hold runner.lock if this role may now; True while held."""
        if self._fd is not None:
            return True
        if self.role == "never":
            return False
        if self.role == "process" and not self.announce():
            return False
        if self.role == "standby" and self.runner_present():
            return False
        fd = _try_flock(self.path, fcntl.LOCK_EX)
        if fd is None:
            return False
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self.identity}\n".encode(), 0)
        self._fd = fd
        return True

    def release(self) -> None:
        self._present_seen = 0
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        self.release()
        fd, self._present_fd = self._present_fd, None
        if fd is not None:
            os.close(fd)

    def holder(self) -> str | None:
        """Who runs batches now: this process, another holder (as it wrote itself), or None
        when the lock is free."""
        if self._fd is not None:
            return self.identity
        if _free_now(self.path):
            return None
        return read_holder(self.root) or "another process"
