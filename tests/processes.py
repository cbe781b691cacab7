"""What is still running, read from /proc."""

import os
import time
from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


# By what the processes are, not by name: vLLM's engine core and workers rename themselves
# (VLLM::EngineCore, VLLM::Worker) and blank their /proc environ, so a scan by command line
# or environment misses exactly the processes that hold the memory (and, on a GPU, the GPU).


def _stat_fields(pid: str) -> list[str]:
    """A process's /proc stat fields from its state on (state, ppid, pgid, sid, ...,
    utime, stime at 11 and 12), [] if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return []
    return raw[raw.rfind(")") + 2 :].split()


def _stat(pid: str) -> list[str]:
    """[state, ppid, pgid, sid] of a process, [] if it is gone."""
    return _stat_fields(pid)[:4]


def _describe(pid: str) -> str:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        comm, cmdline = "?", ""
    return f"{pid} ({comm}): {cmdline.strip()}"


def session_processes(session: int) -> list[str]:
    """Every live process (zombies are gone) whose session or process group is `session`,
    or that descends from a process that is: a full scan of /proc."""
    table = {e.name: _stat(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()}
    live = {pid: f for pid, f in table.items() if len(f) == 4 and f[0] not in ("Z", "X")}
    found = {pid for pid, f in live.items() if str(session) in (f[2], f[3])}
    grew = True
    while grew:  # and their descendants, wherever they went (setsid)
        more = {pid for pid, f in live.items() if f[1] in found and pid not in found}
        found |= more
        grew = bool(more)
    found.discard(str(session))  # the keeper that leads it is not vLLM
    return sorted(_describe(pid) for pid in found if pid in live and _stat(pid))


def job_cgroup_processes(job_id: int) -> list[str]:
    """Every live process in a Slurm job's cgroup (proctrack/cgroup: .../job_<id>/...)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
        except OSError:
            continue
        fields = _stat(entry.name)
        if f"/job_{job_id}/" in cgroups and fields and fields[0] not in ("Z", "X"):
            found.append(_describe(entry.name))
    return found


def _cpu_ticks() -> dict[str, int]:
    """utime + stime of every process, by pid."""
    ticks = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry.name)):
            ticks[entry.name] = int(fields[11]) + int(fields[12])
    return ticks


def busiest_processes(window_s: float = 1.0, top: int = 10) -> str:
    """The `top` processes that used the most CPU over the next `window_s`, one a line with
    their share of one core: for a failure's message, when a test's timing depends on this
    host's load."""
    before, started = _cpu_ticks(), time.monotonic()
    time.sleep(window_s)
    after, window_s = _cpu_ticks(), time.monotonic() - started
    hz = os.sysconf("SC_CLK_TCK")
    used = sorted(((after[pid] - before.get(pid, 0), pid) for pid in after), reverse=True)[:top]
    return "\n".join(
        f"{100 * ticks / hz / window_s:5.0f}% {_describe(pid).replace(chr(10), ' ')[:160]}"
        for ticks, pid in used
    )
