"""The storage connector's directory, kept small: an engine agent's janitor.

vLLM's ExampleConnector (the CPU build's KV transfer, docs/disaggregation.md) writes each new
prompt's KV cache as a folder of one safetensors file per layer under its
`shared_storage_path` (pools[].kv_transfer_dir) and never deletes anything: the directory
grows with every distinct prompt, and what it holds is tenants' prompts in another form. So
every prefill and decode replica that runs it sweeps the directory (they share it: one sweeps
at a time, under a lock file in it, LOCK_NAME; the others skip that round):

- an entry older than `ttl_s` (pools[].kv_transfer_ttl_s; its age from the newest mtime of
  the folder and its files, i.e. when the prefill wrote it) is removed;
- then, while the entries left hold more than `max_bytes` (pools[].kv_transfer_max_mb), the
  oldest go, but never one younger than FRESH_S: that one is a prefill's work its decode has
  not loaded yet (the cap is exceeded for a moment instead).

An entry is removed by renaming it first (one atomic step: an engine either finds the whole
folder or none, never a folder with some layers gone, which would fail its load) to a hidden
name that no prompt's hash has, then deleting that; hidden leftovers (a janitor killed
mid-delete) are deleted by the next sweep.

What an engine must never see (measured with a real vLLM CPU engine and a janitor removing
every entry every 5 ms, docs/disaggregation.md): a folder renamed away while the prefill
writes its layers fails the write, and the engine with it. The janitor never touches an
entry younger than FRESH_S, and the connector writes only folders that did not exist, so
only a janitor acting on a stale look could: hence one janitor at a time (the lock). What
remains: ExampleConnector checks that a prompt's folder exists when it schedules the request
and reads its files in the same engine step; a prompt repeated at the very moment its
folder (older than the TTL) is removed can fall between the two, and that engine's load
fails. The window is one engine step against one sweep every few seconds, for prompts older
than the TTL only; production pools run NIXL, which has no files.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Entries younger than this are never removed for the byte cap: the prefill -> decode handoff
# (the prefill step's answer, then the decode request's wait in its engine's queue).
FRESH_S = 30.0
# Renamed entries on their way out: no prompt's folder (a hex hash) starts with a dot.
TRASH_PREFIX = ".hpcserve-removing-"
# One janitor sweeps at a time (flock; on NFS a lock across nodes): between its look at an
# entry and its removal, no other janitor may remove the entry and a prefill write it anew.
LOCK_NAME = ".hpcserve-janitor.lock"
MB = 1024 * 1024


@dataclass(frozen=True)
class Sweep:
    """What one sweep found and did."""

    expired: int = 0  # entries removed for their age
    expired_bytes: int = 0
    over_cap: int = 0  # entries removed for the byte cap
    over_cap_bytes: int = 0
    left: int = 0  # entries left
    left_bytes: int = 0

    @property
    def removed(self) -> int:
        return self.expired + self.over_cap


@dataclass(frozen=True)
class _Entry:
    path: Path
    mtime: float
    size: int
    is_dir: bool


def _measure(entry: os.DirEntry[str]) -> _Entry:
    """An entry's newest mtime and its bytes (a folder: its files, one level as the
    connector writes them, deeper ones too)."""
    st = entry.stat(follow_symlinks=False)
    mtime, size = st.st_mtime, st.st_size
    is_dir = entry.is_dir(follow_symlinks=False)
    if is_dir:
        size = 0
        for dirpath, _dirs, files in os.walk(entry.path):
            for name in files:
                try:
                    fst = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                size += fst.st_size
                mtime = max(mtime, fst.st_mtime)
    return _Entry(Path(entry.path), mtime, size, is_dir)


def _delete(path: Path, is_dir: bool) -> None:
    if is_dir:
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class KvJanitor:
    """Sweeps one storage directory; `sweep()` is one pass (pure but for the files)."""

    def __init__(
        self,
        root: Path,
        ttl_s: float,
        max_bytes: int,
        *,
        clock: Callable[[], float] = time.time,
        fresh_s: float = FRESH_S,
    ) -> None:
        self.root = root
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.fresh_s = fresh_s
        self._clock = clock  # wall time: it is compared with the files' mtimes

    def sweep(self) -> Sweep:
        """One pass, under the directory's lock; Sweep() when another janitor holds it."""
        try:
            lock = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            return Sweep()  # not made yet: the engine makes it before vLLM starts
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return Sweep()  # another replica's janitor is sweeping it now
            return self._sweep_locked()
        finally:
            os.close(lock)  # and with it the lock

    def _sweep_locked(self) -> Sweep:
        now = self._clock()
        entries: list[_Entry] = []
        for item in os.scandir(self.root):
            if item.name == LOCK_NAME:
                continue
            try:
                measured = _measure(item)
            except FileNotFoundError:
                continue  # removed meanwhile
            if item.name.startswith(TRASH_PREFIX):
                _delete(measured.path, measured.is_dir)  # a janitor's leftover
            else:
                entries.append(measured)
        entries.sort(key=lambda e: e.mtime)  # oldest first
        expired = [e for e in entries if now - e.mtime > self.ttl_s]
        kept = entries[len(expired) :]
        total = sum(e.size for e in kept)
        cut = 0  # the oldest `cut` of those go for the cap
        for entry in kept:
            if total <= self.max_bytes or now - entry.mtime < self.fresh_s:
                break
            cut += 1
            total -= entry.size
        # One gone meanwhile (removed by hand) is not counted.
        expired = [e for e in expired if self._remove(e)]
        over_cap = [e for e in kept[:cut] if self._remove(e)]
        left = kept[cut:]
        return Sweep(
            expired=len(expired),
            expired_bytes=sum(e.size for e in expired),
            over_cap=len(over_cap),
            over_cap_bytes=sum(e.size for e in over_cap),
            left=len(left),
            left_bytes=sum(e.size for e in left),
        )

    def _remove(self, entry: _Entry) -> bool:
        """Rename, then delete; False when it is gone already."""
        trash = entry.path.with_name(f"{TRASH_PREFIX}{entry.path.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(entry.path, trash)
        except FileNotFoundError:
            return False
        _delete(trash, entry.is_dir)
        return True


def describe(root: Path, sweep: Sweep, ttl_s: float, max_bytes: int) -> str:
    """The one log line of a sweep that removed something."""
    return (
        f"kv_transfer_dir {root}: removed {sweep.removed} entries "
        f"({(sweep.expired_bytes + sweep.over_cap_bytes) / MB:.1f} MB): {sweep.expired} older "
        f"than {ttl_s:g}s, {sweep.over_cap} over the {max_bytes / MB:g} MB cap; "
        f"{sweep.left} entries ({sweep.left_bytes / MB:.1f} MB) left"
    )


class JanitorThread:
    """Runs a KvJanitor every `interval_s` on a thread of its own (a sweep walks a shared
    filesystem: it must not delay the agent's heartbeats). Sweeps that removed something
    are logged here and handed to the agent's loop by `reports()`, which sends them to the
    router (its metrics)."""

    def __init__(self, janitor: KvJanitor, interval_s: float) -> None:
        self.janitor = janitor
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._reports: deque[Sweep] = deque(maxlen=1000)
        self._thread = threading.Thread(target=self._run, name="kv-janitor", daemon=True)

    @staticmethod
    def interval_for(ttl_s: float) -> float:
        """A quarter of the TTL, at most 30 s: an entry outlives its TTL by that at most."""
        return min(30.0, ttl_s / 4)

    def start(self) -> None:
        log.info(
            "kv_transfer_dir %s: entries removed after %gs, or beyond %g MB (swept every %gs)",
            self.janitor.root,
            self.janitor.ttl_s,
            self.janitor.max_bytes / MB,
            self.interval_s,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def reports(self) -> list[Sweep]:
        taken: list[Sweep] = []
        while self._reports:
            taken.append(self._reports.popleft())
        return taken

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                sweep = self.janitor.sweep()
            except OSError as err:
                log.warning("kv_transfer_dir %s: sweep failed: %s", self.janitor.root, err)
                continue
            if sweep.removed:
                j = self.janitor
                log.info("%s", describe(j.root, sweep, j.ttl_s, j.max_bytes))
                self._reports.append(sweep)
