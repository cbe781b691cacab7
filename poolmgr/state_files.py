"""Files the pool manager shares with the CLI: its status report and scale overrides.

Both are small JSON documents in the state dir, written atomically (temp file + rename),
so a reader never sees half a file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec

STATUS_FILE = "poolmgr-status.json"
OVERRIDES_FILE = "pool-overrides.json"


class AutoscaleStatus(msgspec.Struct, frozen=True):
    """An autoscaled pool's state (poolmgr/autoscale.py), for `hpcserve status`."""

    target: int
    min: int
    max: int
    signals: str  # "2 serving, 1 starting; 19 in flight, 9 waiting, KV 40%"
    last_reason: str  # the last change: "up 2->4: 9.0 waiting per replica > 2 for 10 s"
    now: str  # this poll's decision: the change, or why it holds
    # What one replica sustains and where the number comes from (autoscale_capacity.py).
    capacity: str = ""


class PoolStatus(msgspec.Struct, frozen=True):
    pool: str
    model: str
    desired: int
    live: int
    serving: int
    admin: int
    draining: int
    retiring: int
    pending: list[str] = []  # "job 12: Resources"
    failures: int = 0
    last_failure: str = ""
    next_submit_in_s: float | None = None
    role: str = "interactive"
    max_replicas: int = 0  # an elastic batch pool's ceiling; 0: a fixed size
    backlog: int | None = None  # an elastic batch pool's Batch API backlog (requests)
    autoscale: AutoscaleStatus | None = None  # an autoscaled pool's target and reasons
    # Its measured cold start (poolmgr/cold_start.py): "95 s p90 (median queue 12 s + ...)".
    cold_start: str = ""


class PoolMgrStatus(msgspec.Struct, frozen=True):
    updated_at: float
    pools: list[PoolStatus]
    unmanaged_pools: list[str] = []


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_status(state_dir: Path, status: PoolMgrStatus) -> None:
    write_atomic(state_dir / STATUS_FILE, msgspec.json.format(msgspec.json.encode(status)))


def read_status(state_dir: Path) -> PoolMgrStatus | None:
    try:
        return msgspec.json.decode((state_dir / STATUS_FILE).read_bytes(), type=PoolMgrStatus)
    except (OSError, msgspec.DecodeError):
        return None


def read_overrides(state_dir: Path) -> dict[str, int]:
    try:
        return msgspec.json.decode((state_dir / OVERRIDES_FILE).read_bytes(), type=dict[str, int])
    except (OSError, msgspec.DecodeError):
        return {}


def write_override(state_dir: Path, pool: str, replicas: int | None) -> dict[str, int]:
    """Set (or with None, clear) a pool's replica override; returns all overrides."""
    overrides = read_overrides(state_dir)
    if replicas is None:
        overrides.pop(pool, None)
    else:
        overrides[pool] = replicas
    write_atomic(state_dir / OVERRIDES_FILE, msgspec.json.encode(overrides))
    return overrides
