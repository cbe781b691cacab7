"""Host-wide reservations of TCP ports chosen now and bound later by another process.

A port checked free when chosen looks just as free to another process on the same host until
its server binds it, and vLLM binds a minute or more later (after loading the model): two
engines starting at once on one node (two Slurm jobs, or the test cluster's nodes, which share
one host) could pick the same port. A reservation is a file named after the port in a
directory every process on the host sees (`$HPCSERVE_PORTS_DIR`, else `hpcserve-ports` under
/run/lock, /dev/shm or /tmp), held with an exclusive flock(2) by the process that reserved it,
which writes its pid and start time into it. A port is taken while its file is locked, or
while the process the file names is alive: a reservation handed to another process
(`hpcserve free-ports --hold-for PID`, for a job script) outlives the short-lived process that
made it. The kernel drops a lock when its holder exits, however it exits, so a reservation
whose holder is gone (and whose named process is gone) is free again without any cleanup;
`sweep` removes such files, which only clutter the directory.

Failure mode: a process that does not take reservations (anything but hpcserve) can still
bind a reserved port first; the engine reports that (engine_launch/engine_ports.py). A Slurm
setup that gives each job a private /tmp and /dev/shm (job_container/tmpfs) hides the
directory from other jobs: set `HPCSERVE_PORTS_DIR` to a host-wide path there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

PORTS_DIR_ENV = "HPCSERVE_PORTS_DIR"
# Host-wide, world-writable places, first the one made for lock files.
DEFAULT_PARENTS = ("/run/lock", "/dev/shm", "/tmp")
DIR_NAME = "hpcserve-ports"


@dataclass(frozen=True)
class Holder:
    pid: int
    # Field 22 of /proc/<pid>/stat: tells a reused pid apart ("" where unknown).
    start: str = ""


def parse_holder(text: str) -> Holder | None:
    """``"1234 98765\\n"`` -> Holder(1234, "98765"); None for an empty or garbled file."""
    parts = text.split()
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts) or int(parts[0]) <= 0:
        return None
    return Holder(int(parts[0]), parts[1] if len(parts) == 2 else "")


def format_holder(holder: Holder) -> str:
    return f"{holder.pid} {holder.start}\n" if holder.start else f"{holder.pid}\n"


def process_start(pid: int) -> str | None:
    """The start time of process `pid` ("" where /proc cannot say); None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def holder_alive(holder: Holder, start: str | None) -> bool:
    """Whether `holder` still runs, given the start time of the process now at its pid."""
    if start is None:
        return False
    return not holder.start or not start or start == holder.start


def this_process() -> Holder:
    pid = os.getpid()
    return Holder(pid, process_start(pid) or "")


def reservations_dir() -> Path:
    explicit = os.environ.get(PORTS_DIR_ENV)
    if explicit:
        return Path(explicit)
    for parent in DEFAULT_PARENTS:
        if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return Path(parent) / DIR_NAME
    return Path("/tmp") / DIR_NAME


def _ensure_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    with contextlib.suppress(FileExistsError):
        directory.mkdir(parents=True)
        # Every user's engines share it; the sticky bit keeps them from removing each other's.
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o1777)


class PortReservation:
    """One reserved port; the lock lives as long as this object's file descriptor."""

    def __init__(self, port: int, path: Path, fd: int) -> None:
        self.port = port
        self.path = path
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Free the port for others (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(fd)

    def hand_over(self, pid: int) -> None:
        """Leave the port reserved for process `pid` until it exits (and drop this lock)."""
        if self._fd is None:
            raise ValueError(f"port {self.port} is no longer reserved")
        start = process_start(pid)
        if start is None:
            raise ValueError(f"cannot hold port {self.port} for pid {pid}: no such process")
        fd, self._fd = self._fd, None
        _write_holder(fd, Holder(pid, start))
        os.close(fd)

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PortReservation({self.port}, {'held' if self.held else 'released'})"


def _write_holder(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, format_holder(holder).encode(), 0)


def _named_holder_alive(fd: int) -> bool:
    holder = parse_holder(os.pread(fd, 64, 0).decode("ascii", "replace"))
    return holder is not None and holder_alive(holder, process_start(holder.pid))


def _lock_current(path: Path) -> int | None:
    """An fd of `path` with our exclusive lock, if nobody holds it and it is still the file
    at `path` (its holder may remove it meanwhile); None otherwise. Creates the file."""
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:
            return None  # another user's file we may not write: treat the port as taken
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_ino, current.st_dev) == (mine.st_ino, mine.st_dev):
            return fd
        os.close(fd)  # released (removed) meanwhile: look again
    return None


def try_reserve(port: int, directory: Path | None = None) -> PortReservation | None:
    """Reserve `port` on this host for this process; None if another process holds it.

    Says nothing about whether the port is bound: check that after reserving."""
    directory = directory or reservations_dir()
    _ensure_dir(directory)
    path = directory / str(port)
    fd = _lock_current(path)
    if fd is None:
        return None
    if _named_holder_alive(fd):
        os.close(fd)
        return None
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)  # another user may reclaim it once this process is gone
    _write_holder(fd, this_process())
    return PortReservation(port, path, fd)


def sweep(directory: Path | None = None) -> int:
    """Remove the files of reservations whose holders are gone; returns how many."""
    directory = directory or reservations_dir()
    try:
        names = [name for name in os.listdir(directory) if name.isdigit()]
    except OSError:
        return 0
    removed = 0
    for name in names:
        path = directory / name
        if not path.exists():
            continue
        fd = _lock_current(path)
        if fd is None:
            continue
        try:
            if not _named_holder_alive(fd):
                path.unlink()
                removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def is_reserved(port: int, directory: Path | None = None) -> bool:
    """Whether a process holds a reservation on `port` now (takes nothing)."""
    path = (directory or reservations_dir()) / str(port)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return True
    try:
        return _named_holder_alive(fd)
    finally:
        os.close(fd)
