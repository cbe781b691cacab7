"""One pool manager per state dir: flock(<state_dir>/run/poolmgr.lock), held for life.

Two pool managers on the same pools would each see the other's jobs as their own (they
share the job name prefix and the comment format), submit the shortfall twice and cancel
each other's surplus. So `hpcserve poolmgr` takes this lock before it touches Slurm and
exits with `EXIT_HELD` (systemd's unit does not restart on it) when another holds it,
naming the holder. The kernel frees the lock when its holder dies, SIGKILL included, so a
crashed pool manager leaves nothing to clean up. On a state dir on NFS (v4, or v3 with
lockd) flock is a lock of the server's, so it also keeps a second control node out.

Failure mode: two installations with *different* state dirs, the same Slurm account and
the same `poolmgr.job_name_prefix` are not caught here; docs/deploy.md says to give each
installation its own prefix.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from hpcserve.contracts.private_files import private_dir

LOCK_FILE = "poolmgr.lock"
EXIT_HELD = 3  # `hpcserve poolmgr`'s exit status when another pool manager holds the lock


class PoolMgrLockHeld(RuntimeError):
    """Another pool manager holds the state dir's lock; the message names it."""

    def __init__(self, path: Path, holder: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(
            f"another pool manager holds {path} ({holder or 'holder unknown'}); two would "
            "submit and cancel each other's jobs. Stop that one first "
            "(`systemctl stop hpcserve-poolmgr` on its host), or give this one another "
            "state_dir and poolmgr.job_name_prefix"
        )


def lock_path(state_dir: Path) -> Path:
    return Path(state_dir) / "run" / LOCK_FILE


def read_holder(state_dir: Path) -> str:
    """What the holder wrote ("pid 123 on ctl01 since 2026-12-01T22:40:00Z"), "" if none."""
    try:
        return lock_path(state_dir).read_text().strip()
    except OSError:
        return ""


def holder_pid(state_dir: Path) -> int | None:
    """The pid of the pool manager that wrote itself into the lock, if that process is still
    a pool manager (its command line says `poolmgr`); None otherwise. Reads only: taking the
    lock to test it could make a pool manager starting at that instant fail."""
    words = read_holder(state_dir).split()
    if len(words) < 2 or words[0] != "pid" or not words[1].isdigit():
        return None
    pid = int(words[1])
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if b"poolmgr" in argv else None


class PoolMgrLock:
    """Held from `acquire` until `release` or the process ends."""

    def __init__(self, state_dir: Path) -> None:
        self.path = lock_path(state_dir)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise PoolMgrLockHeld naming the holder."""
        private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PoolMgrLockHeld(self.path, read_holder(self.path.parent.parent)) from None
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        identity = f"pid {os.getpid()} on {socket.gethostname()} since {since}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, identity.encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor frees the flock
            self._fd = None
