"""Node-local exclusive locks for the cache, and the check that the cache disk is local.

Choice: `fcntl.flock` on a file in the cache root, which must be a local filesystem. The
kernel drops a flock when its holder dies, even by SIGKILL or OOM, so no lock can outlive
its holder and no takeover protocol is needed; a lock directory made with O_EXCL would need
one, and its check-then-delete of a stale holder races between two waiters. flock is only
trustworthy on a local disk: on NFS, Lustre or GPFS it may be emulated per client or
silently succeed, so `check_local_filesystem` refuses such a cache root up front.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import msgspec

from hpcserve.modelcache.procs import Owner

log = logging.getLogger(__name__)

NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs",
        "9p", "afs", "panfs", "wekafs", "ocfs2", "gfs2", "fuse.ceph", "fuse.glusterfs",
        "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs",
    }
)  # fmt: skip


class LockTimeout(TimeoutError):
    """A lock stayed held longer than the caller's timeout."""


class SharedFilesystemError(OSError):
    """A cache root on a network filesystem, where flock cannot be trusted."""


class NodeLock:
    """An exclusive, inter-process and inter-thread lock on a node-local file.

    Algorithm: open (creating) the lock file, then try `flock(LOCK_EX | LOCK_NB)` every
    `poll_s`, backing off to 0.5 s, until `timeout_s`. The holder writes its Owner (pid,
    host, process start time, since) into the file so waiters can say whom they wait for.
    Each acquire opens its own descriptor, so two threads of one process exclude each other
    too. The kernel releases the lock when the holder dies: the next waiter takes it and
    overwrites the dead holder's record. The file is never deleted: a waiter may have it
    open, and deleting it would let a newcomer lock a different inode at the same path.

    Failure mode: on a network filesystem flock may not exclude anything; callers check
    the directory with `check_local_filesystem` first. Not reentrant.
    """

    def __init__(
        self,
        path: Path,
        *,
        poll_s: float = 0.05,
        report_every_s: float = 30.0,
        on_wait: Callable[[Owner | None, float], None] | None = None,
    ) -> None:
        self.path = path
        self.poll_s = poll_s
        self.report_every_s = report_every_s
        self.on_wait = on_wait or self._log_wait
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: lock already held by this object")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._fd = fd
        self._write_owner(fd)
        return True

    def acquire(self, timeout_s: float | None = None) -> None:
        start = time.monotonic()
        delay, next_report = self.poll_s, 0.0
        while not self.try_acquire():
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                holder = self.holder()
                who = holder.describe() if holder else "an unknown holder"
                raise LockTimeout(f"{self.path} still held by {who} after {timeout_s:g}s")
            if waited >= next_report:
                self.on_wait(self.holder(), waited)
                next_report = waited + self.report_every_s
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def holder(self) -> Owner | None:
        """The last holder's record (which may be dead: the lock itself is the truth)."""
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=Owner)
        except (OSError, msgspec.DecodeError):
            return None

    def __enter__(self) -> NodeLock:
        self.acquire()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def _write_owner(self, fd: int) -> None:
        data = msgspec.json.encode(Owner.of())
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def _log_wait(self, holder: Owner | None, waited_s: float) -> None:
        who = holder.describe() if holder else "another process"
        log.info("waiting for %s, held by %s (%.0fs so far)", self.path.name, who, waited_s)


def filesystem_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The filesystem type of the mount holding `path`, from /proc/self/mountinfo (or the
    text given); None where that file is unavailable."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest:
            continue
        mount_point = _unescape(parts[4])
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, rest.split()[0]
    return best_type


def check_local_filesystem(path: Path, mountinfo: str | None = None) -> None:
    fs = filesystem_type(path, mountinfo)
    if fs in NETWORK_FILESYSTEMS:
        raise SharedFilesystemError(
            f"cache directory {str(path)!r} is on a {fs} filesystem; the node cache needs a "
            "node-local disk (flock is not reliable on shared filesystems)"
        )


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
