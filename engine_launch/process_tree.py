"""vLLM's whole process tree, owned by the engine.

vLLM's API server starts an engine core and workers that rename themselves (`VLLM::...`)
and blank their /proc environ; the API server does not act on SIGTERM while it loads the
model, and killed alone it leaves them running, reparented to init (vllm-cpu.md, "Process
life"). So the engine never starts vLLM itself. It starts a keeper,
`python -m hpcserve.engine_launch.process_tree`, a small process that

- leads a session and process group of its own (the engine starts it with
  start_new_session) and starts vLLM in it: every process of vLLM is in that session, under
  whatever name, so the session id (the keeper's pid) names the tree;
- is the tree's child subreaper (PR_SET_CHILD_SUBREAPER): a process whose parent dies is
  reparented to the keeper, not to init, and the keeper reaps it; so the keeper exits only
  once the whole tree is gone, and its exit is the engine's proof of that;
- holds the read end of a pipe, the lifeline, whose only write end the engine holds: when
  the engine is gone, however it died (SIGKILL included), the pipe reads end-of-file and
  the keeper ends the tree itself: SIGTERM to every process of it, SIGKILL to what is left
  after `--grace-s`, then one log line saying what it stopped, and exits;
- forwards SIGTERM, SIGINT, SIGHUP and SIGUSR1 to the API server alone (vLLM drains on
  SIGTERM only when its workers do not get it too), and tells the engine the API server's
  pid and, when it is reaped, its exit code, over a second pipe.

The engine's side is VllmTree: it signals the API server through the keeper, and stops
the rest by what the processes are, never by name: every process whose session or process
group is the keeper's, or that descends from the keeper, found by a full scan of /proc.
A session id cannot be reused while any process (a zombie keeper included) still has it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MODULE = "hpcserve.engine_launch.process_tree"
log = logging.getLogger(MODULE)  # the same name when run as the keeper (__main__)

# SIGTERM -> SIGKILL for a vLLM with nothing to drain (not serving yet, or its engine gone).
GRACE_S = 5.0
# How long a SIGKILLed tree may take to be gone (the kernel frees GBs of memory).
KILL_WAIT_S = 30.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str

    @property
    def live(self) -> bool:
        return self.state not in ("Z", "X")


def process_table() -> dict[int, Proc]:
    """Every process of the machine (a full scan of /proc)."""
    table: dict[int, Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) S ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = raw[raw.rfind(")") + 2 :].split()
        if len(fields) < 4:
            continue
        pid = int(entry.name)
        table[pid] = Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), fields[0])
    return table


def tree_members(leader: int, table: dict[int, Proc] | None = None) -> list[int]:
    """The live processes of the tree `leader` keeps: those in its session or process group,
    and those below it by parentage (one that left the session with setsid); not the leader
    itself, not zombies."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found = {p.pid for p in table.values() if p.sid == leader or p.pgid == leader}
    todo = list(children.get(leader, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
        todo.extend(c for c in children.get(pid, []) if c not in found)
    found.discard(leader)
    return sorted(pid for pid in found if table.get(pid) and table[pid].live)


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def describe_pids(pids: Sequence[int]) -> str:
    return ", ".join(map(str, pids)) if pids else "none"


def _set_child_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init; the session remains
        pass


# ---------------------------------------------------------------- the keeper (own process)


class _Keeper:
    def __init__(self, lifeline: int, status: int, grace_s: float) -> None:
        self.lifeline = lifeline
        self.status = status
        self.grace_s = grace_s
        self.me = os.getpid()
        self.engine = os.getppid()
        self.api = 0
        self.api_code: int | None = None

    def say(self, line: str) -> None:
        with contextlib.suppress(OSError):  # the engine is gone: nobody to tell
            os.write(self.status, f"{line}\n".encode())

    def forward(self, sig: int, _frame: object) -> None:
        if self.api and self.api_code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.api, sig)

    def reap(self) -> bool:
        """Reap every child that has exited; False once none is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.api:
                self.api_code = os.waitstatus_to_exitcode(status)
                self.say(f"exit {self.api_code}")

    def run(self, argv: list[str]) -> int:
        for fd in (self.lifeline, self.status):
            os.set_inheritable(fd, False)
        _set_child_subreaper()
        for sig in FORWARDED:
            signal.signal(sig, self.forward)
        try:
            # Signals Python ignores go back to their default, as subprocess does.
            self.api = os.posix_spawnp(
                argv[0], argv, dict(os.environ), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ)
            )
        except OSError as err:
            log.error("cannot start %s: %s", argv[0], err)
            self.say("exit 127")
            return 127
        self.say(f"pid {self.api}")
        while self.reap():
            ready, _, _ = select.select([self.lifeline], [], [], 0.2)
            if ready and not os.read(self.lifeline, 4096):
                self.end_tree()
                break
        code = self.api_code if self.api_code is not None else 0
        return code if code >= 0 else 128 - code

    def end_tree(self) -> None:
        """The engine is gone: nobody will drain or stop vLLM, so stop it now."""
        pids = tree_members(self.me)
        signal_pids(pids, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self.reap() and tree_members(self.me) and time.monotonic() < deadline:
            time.sleep(0.1)
        killed: set[int] = set()
        deadline = time.monotonic() + KILL_WAIT_S
        while (left := tree_members(self.me)) and time.monotonic() < deadline:
            killed.update(left)
            signal_pids(left, signal.SIGKILL)
            self.reap()
            time.sleep(0.05)
        while self.reap() and time.monotonic() < deadline:
            time.sleep(0.05)
        how = (
            f"killed (SIGTERM, then SIGKILL after {self.grace_s:g}s to pids "
            f"{describe_pids(sorted(killed))})"
            if killed
            else "terminated (SIGTERM)"
        )
        log.warning(
            "the engine (pid %d) is gone: vLLM's process tree (session %d: pids %s) %s",
            self.engine,
            self.me,
            describe_pids(pids),
            how,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcserve.engine_launch.process_tree")
    parser.add_argument("--lifeline", type=int, required=True)
    parser.add_argument("--status", type=int, required=True)
    parser.add_argument("--grace-s", type=float, default=GRACE_S)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    from hpcserve.logs import setup_logging

    setup_logging("engine")
    return _Keeper(args.lifeline, args.status, args.grace_s).run(command)


# ---------------------------------------------------------------- the engine's side


class VllmTree:
    """The engine's handle on one vLLM: its keeper and, through it, its whole tree.

    `poll()`/`returncode` are the API server's exit code (like Popen's); `session` is the
    keeper's pid, the session and process group of every process of the tree."""

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        grace_s: float = GRACE_S,
        pass_fds: Sequence[int] = (),
    ):
        """pass_fds: open files vLLM inherits (the HTTP socket the engine made), through the
        keeper, at the same numbers."""
        lifeline_r, self._lifeline = os.pipe()
        status_r, status_w = os.pipe()
        try:
            self._keeper = subprocess.Popen(
                [sys.executable, "-m", MODULE, "--lifeline", str(lifeline_r),
                 "--status", str(status_w), "--grace-s", f"{grace_s:g}", "--", *argv],
                env=env,
                start_new_session=True,
                pass_fds=(lifeline_r, status_w, *pass_fds),
            )  # fmt: skip
        except BaseException:
            for fd in (status_r, self._lifeline):
                os.close(fd)
            raise
        finally:
            os.close(lifeline_r)
            os.close(status_w)
        os.set_blocking(status_r, False)
        self._status = status_r
        self._buffer = b""
        self.session = self._keeper.pid
        self._pid = 0
        self.returncode: int | None = None
        self._keeper_code: int | None = None
        self._closed = False

    def _read_status(self) -> None:
        while self._status >= 0:
            try:
                data = os.read(self._status, 4096)
            except BlockingIOError:
                return
            if not data:
                os.close(self._status)
                self._status = -1
                return
            self._buffer += data
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                word, _, value = line.decode().partition(" ")
                if word == "pid":
                    self._pid = int(value)
                elif word == "exit":
                    self.returncode = int(value)

    @property
    def pid(self) -> int:
        """The API server's pid (0 until the keeper has started it)."""
        self._read_status()
        return self._pid

    def keeper_exited(self) -> bool:
        """Whether the keeper exited (not reaped yet, so its session id stays taken)."""
        if self._keeper_code is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self._keeper.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already (close)
            self._keeper_code = self._keeper.returncode or 0
            return True
        if info is None:
            return False
        if info.si_code == os.CLD_EXITED:
            self._keeper_code = info.si_status
        else:
            self._keeper_code = -info.si_status
        return True

    def poll(self) -> int | None:
        self._read_status()
        if self.returncode is None and self.keeper_exited():
            self._read_status()
            if self.returncode is None:  # the keeper died before vLLM did (killed)
                self.returncode = self._keeper_code
        return self.returncode

    def wait(self, timeout_s: float) -> int | None:
        """The API server's exit code, or None if it still runs after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.returncode

    def members(self) -> list[int]:
        """Every live process of vLLM's tree (the keeper not included)."""
        return tree_members(self.session)

    def signal_api(self, sig: int) -> None:
        """`sig` to the API server alone (the keeper forwards it)."""
        if not self.keeper_exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._keeper.pid, sig)

    def _until_gone(self, deadline: float, sig: int | None) -> bool:
        """Until the keeper has exited (the tree is gone) or `deadline`: send `sig` to every
        process of the tree, those that appear meanwhile too. True once gone."""
        signalled: set[int] = set()
        while True:
            if self.keeper_exited() and not self.members():
                return True
            if time.monotonic() >= deadline:
                return False
            if sig is not None:
                fresh = [p for p in self.members() if p not in signalled]
                signal_pids(fresh, sig)
                signalled.update(fresh)
            time.sleep(0.05)

    def terminate(self, grace_s: float = GRACE_S) -> str:
        """SIGTERM to every process of the tree, SIGKILL to what is left after `grace_s`.
        Says which it took."""
        if self._until_gone(time.monotonic() + grace_s, signal.SIGTERM):
            return "terminated (SIGTERM)"
        self.kill()
        return f"killed (SIGTERM, then SIGKILL after {grace_s:g}s)"

    def kill(self) -> bool:
        """SIGKILL to every process of the tree (those that appear meanwhile too) until it is
        gone; False if some survive KILL_WAIT_S (stuck in the kernel)."""
        return self._until_gone(time.monotonic() + KILL_WAIT_S, signal.SIGKILL)

    def close(self, grace_s: float = GRACE_S) -> list[int]:
        """Wait up to `grace_s` for the tree to be gone (vLLM's processes exit after its API
        server), kill what is left, reap the keeper. Returns the pids it had to kill."""
        if self._closed:
            return []
        left: list[int] = []
        if not self._until_gone(time.monotonic() + grace_s, None):
            left = self.members()
            self.kill()
        if not self.keeper_exited():  # the keeper itself hangs (stopped?): end it too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.session, signal.SIGKILL)
        # The keeper is dead or a zombie (the session id stays ours): sweep by session, for
        # processes that outlived a keeper killed from outside.
        stray = self.members()
        if stray:
            left += stray
            self.kill()
        self._keeper.wait()
        self.poll()
        self._closed = True
        os.close(self._lifeline)
        if self._status >= 0:
            os.close(self._status)
            self._status = -1
        return sorted(set(left))


if __name__ == "__main__":
    sys.exit(main())
