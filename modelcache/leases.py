"""Leases: a file per running engine that marks a cache entry as in use.

`<cache>/.leases/<key>/<pid>-<nonce>.json` holds the engine's Owner (pid, host, process
start time). An entry with a live lease is never evicted. A lease whose process is gone
(or whose pid now belongs to a process started later) is stale: it is ignored, and removed
by whoever next holds the entry's lock. An engine that dies without releasing therefore
blocks eviction only until someone looks.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import msgspec

from hpcserve.modelcache.procs import Owner

_decoder = msgspec.json.Decoder(Owner)


class Lease(msgspec.Struct, frozen=True):
    key: str
    path: Path
    owner: Owner


def lease_dir(root: Path, key: str) -> Path:
    return root / ".leases" / key


def write_lease(root: Path, key: str, pid: int) -> Lease:
    """Record that process `pid` uses entry `key` (atomically: temp file then rename)."""
    owner = Owner.of(pid)
    directory = lease_dir(root, key)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pid}-{secrets.token_hex(4)}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(owner))
    os.replace(tmp, path)
    return Lease(key, path, owner)


def release_lease(lease: Lease) -> None:
    lease.path.unlink(missing_ok=True)


def read_leases(root: Path, key: str) -> list[Lease]:
    """All leases of `key`, live or stale; unreadable files count as stale leases of pid 0."""
    leases = []
    for path in sorted(lease_dir(root, key).glob("*.json")):
        try:
            owner = _decoder.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError):
            owner = Owner(pid=0, host=socket.gethostname())
        leases.append(Lease(key, path, owner))
    return leases


def live_leases(root: Path, key: str) -> list[Lease]:
    return [lease for lease in read_leases(root, key) if lease.owner.alive()]


def prune_stale(root: Path, key: str) -> list[Lease]:
    """Delete the stale leases of `key` (caller holds the entry lock); return the live ones."""
    live = []
    for lease in read_leases(root, key):
        if lease.owner.alive():
            live.append(lease)
        else:
            release_lease(lease)
    return live
