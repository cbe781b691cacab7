"""Parallel chunked copy of a manifest's files, each file's digest checked on the way."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hpcserve.modelcache.errors import DigestMismatchError, SourceChangedError
from hpcserve.modelcache.manifest import (
    DEFAULT_WORKERS,
    FileEntry,
    Hasher,
    Manifest,
    ProgressSink,
    new_hasher,
)

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 8 << 20
# sendfile(2) cannot copy between these files: fall back to pread/pwrite
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOTSOCK}
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


@dataclass(eq=False)
class _FileCopy:
    """One file in flight: its descriptors, its digest so far, the next chunk to hash."""

    entry: FileEntry
    chunks: int
    hasher: Hasher
    src_fd: int = -1
    dst_fd: int = -1
    next_chunk: int = 0
    turn: threading.Condition = field(default_factory=threading.Condition)


class ChunkCopier:
    """Copy the files of a manifest with `workers` threads, hashing every byte copied.

    Algorithm: every file is cut into `chunk_bytes` chunks. One dispatcher hands chunks out
    in a fixed order, round-robin over a window of `workers` files (largest first), so
    several files are copied and hashed at once and a single large file still gets every
    thread. A worker copies its chunk in the kernel (sendfile: source to the destination's
    page cache, no trip through Python), then waits for its turn and feeds the chunk's
    bytes, mapped from the destination's page cache, to that file's hasher: chunk i only
    after chunk i-1. What is hashed is what was written, and nothing is read twice from
    the source or the disk. The wait cannot deadlock: chunk i-1 was handed out before
    chunk i, so a chain of waiters always ends at a worker that is not waiting. The worker
    that hashes a file's last chunk compares the digest, fsyncs (if durable) and closes it.
    Where sendfile cannot copy between the two files, chunks go through pread/pwrite.

    Failure mode: the first error (I/O, a source whose size changed, a digest mismatch)
    stops every worker; `run` re-raises it and the caller deletes the target directory.
    """

    def __init__(
        self,
        manifest: Manifest,
        source: Path,
        workers: int = DEFAULT_WORKERS,
        chunk_bytes: int = COPY_CHUNK_BYTES,
        progress: ProgressSink | None = None,
        durable: bool = False,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % mmap.ALLOCATIONGRANULARITY:
            raise ValueError(f"chunk_bytes must be a multiple of {mmap.ALLOCATIONGRANULARITY}")
        self.manifest, self.source, self.target = manifest, source, Path()
        self.workers = max(1, workers)
        self.chunk_bytes = chunk_bytes
        self.progress = progress
        self.durable = durable
        self._files = [
            _FileCopy(f, max(1, -(-f.size // chunk_bytes)), new_hasher(manifest.algorithm))
            for f in sorted(manifest.files, key=lambda f: -f.size)
        ]
        self._plan = _interleave(self._files, self.workers)
        self._dispatch = threading.Lock()
        self._failed = threading.Event()
        self._error: BaseException | None = None
        self._sendfile = True
        self._buffers = threading.local()

    def run(self, target: Path) -> None:
        """Copy every file into the existing directory `target`; once per copier."""
        self.target = target
        threads = [
            threading.Thread(target=self._work, name=f"stage-{i}", daemon=True)
            for i in range(self.workers)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException as err:  # KeyboardInterrupt while joining
            self._fail(err)
            for t in threads:
                t.join()
            raise
        finally:
            for fc in self._files:
                _close(fc)
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        try:
            while (item := self._next()) is not None:
                self._copy_chunk(*item)
        except BaseException as err:
            self._fail(err)

    def _next(self) -> tuple[_FileCopy, int] | None:
        with self._dispatch:
            if self._failed.is_set():
                return None
            item = next(self._plan, None)
            if item is not None and item[1] == 0:
                self._open(item[0])
            return item

    def _open(self, fc: _FileCopy) -> None:
        src = self.source / fc.entry.path
        dst = self.target / fc.entry.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        fc.src_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(fc.src_fd).st_size
        if size != fc.entry.size:
            raise SourceChangedError(
                f"{src}: {size} bytes, but the manifest says {fc.entry.size} "
                "(changed since `hpcserve models add`?)"
            )
        os.posix_fadvise(fc.src_fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        fc.dst_fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        if size:
            try:
                os.posix_fallocate(fc.dst_fd, 0, size)  # ENOSPC now, not half-way
            except OSError as err:
                if err.errno != errno.EOPNOTSUPP:  # this filesystem cannot preallocate
                    raise

    def _copy_chunk(self, fc: _FileCopy, index: int) -> None:
        offset = index * self.chunk_bytes
        length = min(self.chunk_bytes, fc.entry.size - offset)
        self._transfer(fc, offset, length)
        with fc.turn:
            while fc.next_chunk != index:
                if self._failed.is_set():
                    return
                fc.turn.wait(0.1)
            if length:
                with mmap.mmap(
                    fc.dst_fd, length, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ, offset=offset
                ) as view:
                    fc.hasher.update(memoryview(view))
            fc.next_chunk += 1
            fc.turn.notify_all()
            if fc.next_chunk == fc.chunks:
                self._finish(fc)
        if self.progress is not None and length:
            self.progress.advance(length)

    def _transfer(self, fc: _FileCopy, offset: int, length: int) -> None:
        src = self.source / fc.entry.path
        if self._sendfile:
            try:
                _sendfile_range(fc.src_fd, self.target / fc.entry.path, offset, length, src)
                return
            except OSError as err:
                if err.errno not in _NO_SENDFILE:
                    raise
                log.info("sendfile cannot copy %s (%s); using pread/pwrite", src, err.strerror)
                self._sendfile = False
        _pread_pwrite_range(fc.src_fd, fc.dst_fd, offset, length, self._buffer(), src)

    def _buffer(self) -> memoryview:
        buf = getattr(self._buffers, "buf", None)
        if buf is None:
            buf = self._buffers.buf = memoryview(bytearray(self.chunk_bytes))
        return buf

    def _finish(self, fc: _FileCopy) -> None:
        actual = fc.hasher.hexdigest()
        if actual != fc.entry.digest:
            raise DigestMismatchError(fc.entry.path, fc.entry.digest, actual)
        os.fchmod(fc.dst_fd, 0o444)
        if self.durable:
            os.fsync(fc.dst_fd)
        _close(fc)

    def _fail(self, err: BaseException) -> None:
        with self._dispatch:
            if self._error is None:
                self._error = err
            self._failed.set()


def _interleave(files: list[_FileCopy], window: int) -> Iterator[tuple[_FileCopy, int]]:
    """(file, chunk index) pairs: each file's chunks in order, round-robin over `window`
    files at a time, the next file joining when one is done."""
    pending = deque(files)
    active: deque[tuple[_FileCopy, int]] = deque()
    while pending or active:
        while pending and len(active) < window:
            active.append((pending.popleft(), 0))
        fc, index = active.popleft()
        yield fc, index
        if index + 1 < fc.chunks:
            active.append((fc, index + 1))


def _sendfile_range(src_fd: int, dst: Path, offset: int, length: int, src: Path) -> None:
    """Copy [offset, offset+length) in the kernel. sendfile writes at the output's file
    position, so each call gets its own descriptor of the destination."""
    out = os.open(dst, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.lseek(out, offset, os.SEEK_SET)
        done = 0
        while done < length:
            n = os.sendfile(out, src_fd, offset + done, length - done)
            if n == 0:
                raise SourceChangedError(f"{src}: ended at byte {offset + done}, expected more")
            done += n
    finally:
        os.close(out)


def _pread_pwrite_range(
    src_fd: int, dst_fd: int, offset: int, length: int, buf: memoryview, src: Path
) -> None:
    done = 0
    while done < length:
        n = os.preadv(src_fd, [buf[: length - done]], offset + done)
        if n == 0:
            raise SourceChangedError(f"{src}: ended at byte {offset + done}, expected more")
        written = 0
        while written < n:
            written += os.pwrite(dst_fd, buf[written:n], offset + done + written)
        done += n


def _close(fc: _FileCopy) -> None:
    for fd in (fc.src_fd, fc.dst_fd):
        if fd >= 0:
            os.close(fd)
    fc.src_fd = fc.dst_fd = -1
