"""Owner-only files at rest: the state dir, secrets, batch files, databases, logs.

Directories are 0700 and files 0600 whatever the umask, so another user of the cluster (a
shell on the login node, a job on our nodes) can read none of them. A path that already
exists with group or other bits (an older release made it, a copy, a hand edit) is
tightened to its owner's bits, and that is logged once per path and process. A path owned
by someone else is left as it is (only its owner or root may change it) and logged.

The node-local model cache does not come here: weights are not secrets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_reported: set[str] = set()


def tighten(path: str | os.PathLike[str]) -> None:
    """Drop the group and other bits of an existing file or directory (logged once if it
    had any). Anything else (/dev/null as an audit log, a pipe) is left alone."""
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077 or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return
    key = os.fspath(path)
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        if key not in _reported:
            _reported.add(key)
            log.warning(
                "%s is mode %04o and owned by uid %d, not this account: others may read it",
                key, mode, st.st_uid,
            )  # fmt: skip
        return
    os.chmod(path, mode & 0o700)
    if key not in _reported:
        _reported.add(key)
        log.warning("%s was mode %04o: now %04o (owner only)", key, mode, mode & 0o700)


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a directory only its owner may enter (made with its parents if absent; the
    parents keep the umask's mode)."""
    path = Path(path)
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    tighten(path)
    return path


def private_file(path: str | os.PathLike[str]) -> Path:
    """`path` as a file only its owner may read (created empty if absent), e.g. before
    SQLite opens it: SQLite gives its journal and WAL files the database file's mode."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        tighten(path)
    else:
        os.close(fd)
    return path


def private_opener(path: str, flags: int) -> int:
    """For open(..., opener=private_opener): a file it creates is 0600 from the start."""
    return os.open(path, flags, 0o600)


def open_private_append(path: str | os.PathLike[str]) -> int:
    """A file descriptor appending to `path` (0600, created if absent)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    tighten(path)
    return fd


def write_private(path: str | os.PathLike[str], data: bytes) -> Path:
    """Replace `path` atomically with `data`, mode 0600 (the temporary file is mkstemp's,
    0600 from the start: the content is never readable by others, not even for a moment)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
