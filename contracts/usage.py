"""Usage records: one JSON line per request that an engine (or the external API) served, the
durable ground truth of tokens served per tenant, model and replica (`hpcserve report`).

Written by the gateway (interactive requests) and the batch runner (batch lines) into
`gateway.usage_dir` (default `<state_dir>/usage`), read by hpcserve/report/. Apart from the
audit log (gateway/audit.py) on purpose: the audit log may be off or mixed into the service
log, and it has a line for every refused request; usage is always on, in files of its own,
and names the replica (so the Slurm job and pool) that did the work.

Files: `<usage_dir>/<YYYY-MM-DD>.<source>.<host>.jsonl` (UTC day of the request's end;
source "gateway" or "batch"). One writer's line is one append (O_APPEND, a line of a few
hundred bytes), so processes on one host share a file; hosts never share one (an append on
NFS is not atomic). Appended lines are the kernel's as soon as write(2) returns: a crashed or
killed process loses none; the writer fdatasyncs at most `SYNC_S` after a write, so a host
that loses power loses at most that much.

A line that does not decode (a torn last line after a power loss) is skipped and counted by
the reader, never fatal.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

SYNC_S = 1.0
_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})\.([a-z]+)\.[^/]+\.jsonl$")
# engine_launch/engine.py names a replica "<pool>-j<job id>-<6 hex>" inside a Slurm job and
# "<pool>-<host>-<pid>-<6 hex>" outside one.
_REPLICA = re.compile(r"^(?P<pool>.+)-j(?P<job>\d+)-[0-9a-f]{6}$")


class UsageRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    start: float  # epoch seconds (ms precision): the request reached the gateway / runner
    end: float  # the answer's last byte
    tenant: str
    model: str  # what the client asked for: a model, an alias or a LoRA adapter
    prompt_tokens: int
    completion_tokens: int
    status: int
    replica: str = ""  # "" for the external API (overflow)
    served: str = ""  # the name the engine served it as (an alias's version); "": = model
    version: str = ""  # the registry version the replica serves (name@version), if any
    adapter: str = ""  # the LoRA adapter, for a LoRA request
    key_id: str = ""
    request_id: str = ""
    source: str = "gateway"  # or "batch"
    external: bool = False  # served by the external API, not by our GPUs


def encode(record: UsageRecord) -> bytes:
    return _encode(record) + b"\n"


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(UsageRecord).decode


def day_of(epoch: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(epoch))


def file_name(epoch: float, source: str, host: str) -> str:
    return f"{day_of(epoch)}.{source}.{host}.jsonl"


def replica_job(replica: str) -> tuple[str, int] | None:
    """(pool, Slurm job id) of a replica id; None for a replica outside Slurm (local)."""
    match = _REPLICA.match(replica)
    return (match.group("pool"), int(match.group("job"))) if match else None


@dataclass
class ReadStats:
    files: int = 0
    records: int = 0
    bad_lines: int = 0


def read_records(
    usage_dir: Path, since: float, until: float, stats: ReadStats | None = None
) -> Iterator[UsageRecord]:
    """Every record whose end lies in [since, until), from the day files that can hold one."""
    stats = stats if stats is not None else ReadStats()
    if not usage_dir.is_dir():
        return
    first, last = day_of(since), day_of(until)
    for path in sorted(usage_dir.iterdir()):
        match = _NAME.match(path.name)
        if match is None or not first <= match.group(1) <= last:
            continue
        stats.files += 1
        with path.open("rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = _decode(line)
                except msgspec.DecodeError:
                    stats.bad_lines += 1
                    continue
                if since <= record.end < until:
                    stats.records += 1
                    yield record


__all__ = [
    "SYNC_S",
    "ReadStats",
    "UsageRecord",
    "day_of",
    "encode",
    "file_name",
    "read_records",
    "replica_job",
]
