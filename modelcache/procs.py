"""Who holds a lock or a lease: pid, host and process start time, and whether it still runs.

A pid alone is not an identity: pids are reused, so a record also keeps the process's
start time (field 22 of /proc/PID/stat, clock ticks since boot). A record is alive when
its pid exists with the same start time. A record from another host cannot be checked
and counts as alive, the safe answer for "may I delete what it uses".
"""

from __future__ import annotations

import os
import socket
import time

import msgspec


class Owner(msgspec.Struct, frozen=True):
    pid: int
    host: str
    start_time: int | None = None
    since: float = 0.0

    @classmethod
    def of(cls, pid: int | None = None) -> Owner:
        pid = os.getpid() if pid is None else pid
        return cls(pid, socket.gethostname(), process_start_time(pid), time.time())

    def alive(self) -> bool:
        if self.host != socket.gethostname():
            return True
        if not pid_exists(self.pid) or _stat_fields(self.pid)[:1] == [b"Z"]:
            return False  # gone, or a zombie nobody has reaped yet
        now = process_start_time(self.pid)
        return now is None or self.start_time is None or now == self.start_time

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host} since {when}"


def pid_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None where /proc cannot tell."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _stat_fields(pid: int) -> list[bytes]:
    """Fields 3.. of /proc/PID/stat (state first), or [] where there is no such file."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    # the command name (field 2) may hold spaces and parentheses: split after the last ")"
    return stat[stat.rfind(b")") + 2 :].split()
