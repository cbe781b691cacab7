"""Xids from the kernel log, for the one-shot `health check` (NVML reports an Xid only to an
event set that was listening when it happened; the driver also logs every one).

Records are read from /dev/kmsg (root, as slurmd runs its HealthCheckProgram): one record
per read, "prio,seq,usec,flags;message". The last sequence number seen is kept in the
check's state directory, so each check sees the Xids since the previous one; the first
check only records where the log stands (history before it is not judged). Pure parser,
table-tested; the driver's line is

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

_XID = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+)\b")


@dataclass(frozen=True)
class KernelXid:
    seq: int
    pci: str  # normalised "0000:3b:00"
    xid: int


def normalise_pci(bus_id: str) -> str:
    """ "00000000:3B:00.0" (NVML) or "0000:3b:00" (the driver's log) -> "0000:3b:00"."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) < 3:
        return bus_id.strip().lower()
    domain, bus, device = parts[-3], parts[-2], parts[-1].split(".")[0]
    return f"{domain[-4:]:0>4}:{bus:0>2}:{device:0>2}"


def parse_kmsg_record(record: str) -> tuple[int, str] | None:
    """(sequence number, message) of one /dev/kmsg record; None if it is not one."""
    head, sep, message = record.partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 3 or not fields[1].isdigit():
        return None
    return int(fields[1]), message.split("\n", 1)[0]


def parse_xids(records: list[str], after_seq: int) -> list[KernelXid]:
    found = []
    for record in records:
        parsed = parse_kmsg_record(record)
        if parsed is None or parsed[0] <= after_seq:
            continue
        seq, message = parsed
        match = _XID.search(message)
        if match:
            found.append(KernelXid(seq, normalise_pci(match["pci"]), int(match["xid"])))
    return found


def read_kmsg(path: str = "/dev/kmsg") -> list[str]:
    """Every record in the kernel's buffer now (non-blocking); [] when not readable. A path
    other than /dev/kmsg is a file of records, one per line (tests, saved logs)."""
    if path != "/dev/kmsg":
        try:
            return Path(path).read_text(errors="replace").splitlines()
        except OSError:
            return []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    records = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except OSError as err:
                if err.errno == errno.EPIPE:  # overwritten while reading: skip ahead
                    continue
                break  # EAGAIN: the end
            if not chunk:
                break
            records.append(chunk.decode("utf-8", "replace"))
    finally:
        os.close(fd)
    return records


def last_seq(records: list[str]) -> int:
    seqs = [p[0] for r in records if (p := parse_kmsg_record(r)) is not None]
    return max(seqs, default=0)


def xids_since(records: list[str], stored: int | None) -> tuple[list[KernelXid], int]:
    """The Xids after the stored sequence number, and the number to store next. No stored
    number: a baseline, nothing judged. A stored number beyond the log: the node rebooted
    (numbering starts again), so everything in the log is new."""
    newest = last_seq(records)
    if stored is None:
        return [], newest
    after = 0 if stored > newest else stored
    return parse_xids(records, after), max(newest, after)


def read_seq(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def write_seq(path: Path, seq: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(seq))
    tmp.replace(path)
