"""A real two-node Slurm cluster on one machine, for the demo (`hpcserve up`) and the tests.

Everything lives under `LocalSlurmSpec.state_dir`: slurm.conf, gres.conf, the plain files that
stand in for GPUs, slurmctld's state, the slurmd spools, logs and pid files. Nothing is written
to /etc except the munge key when the machine has none (`mungekey -c`, the standard place).
munged is shared machine-wide: it is started when no munged answers and stopped again only by
the `LocalSlurm` that started it (recorded in `<state_dir>/munged.owner`, so a `stop()` from
another process knows), and only when no other slurmctld/slurmd on the machine still needs it.

Several clusters can coexist (the demo on 16817, tests on other ports): each has its own
state dir, its own ports (slurmctld on `ctld_port`, slurmd i on `ctld_port + i`) and every
daemon gets `-f <state_dir>/slurm.conf` plus `SLURM_CONF` in its environment. Client commands
(sbatch, squeue, scancel, scontrol, sinfo) all honour `SLURM_CONF`; use `env()`.

Requires root (slurmd launches jobs as their user; SlurmUser is root) and Debian's
`slurmctld slurmd slurm-client munge` packages; `preflight()` says what is missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hpcserve import local_accounting as acct

log = logging.getLogger(__name__)

APT_HINT = "apt-get install slurmctld slurmd slurm-client munge"
_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"]
)
# binary -> Debian package that ships it
_BINARIES = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sinfo": "slurm-client",
    "sbatch": "slurm-client",
    "squeue": "slurm-client",
    "scancel": "slurm-client",
    "scontrol": "slurm-client",
    "munged": "munge",
    "munge": "munge",
    "mungekey": "munge",
}
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN_DIR = Path("/run/munge")
MUNGE_PID_FILE = MUNGE_RUN_DIR / "munged.pid"
MUNGE_LOG = Path("/var/log/munge/munged.log")
_OWNER_FILE = "munged.owner"
JOB_IDS_PER_CLUSTER = 1000
# Read by slurmd with proctrack/cgroup (from slurm.conf's directory). autodetect: v2 where
# /sys/fs/cgroup is cgroup2, else v1; IgnoreSystemd: v2 without systemd/dbus (slurmd makes
# its own cgroups), ignored by v1.
CGROUP_CONF = """# Written by hpcserve.localslurm.
CgroupPlugin=autodetect
CgroupMountpoint=/sys/fs/cgroup
IgnoreSystemd=yes
"""
# sinfo %T states in which a node takes work (a busy node of an already running cluster is fine)
_USABLE_STATES = {"idle", "mixed", "allocated", "completing"}


class LocalSlurmError(RuntimeError):
    """The local cluster could not be started or stopped; the message names the log to read."""


@dataclass(frozen=True)
class LocalSlurmSpec:
    state_dir: Path
    ctld_port: int = 16817  # slurmd i listens on ctld_port + i
    nodes: int = 2
    gpus_per_node: int = 4
    # Configured CPUs per node. slurmd would mark a node INVAL if this exceeded what it
    # detects; slurm.conf sets SlurmdParameters=config_overrides, so the configured value wins
    # (a larger one just over-subscribes the machine). With CR_Core each job takes >= 1 CPU,
    # so this also caps how many jobs run per node.
    cpus_per_node: int = 2
    memory_mb: int = 8000
    partition: str = "gpu"
    # A second partition over the same nodes for batch pools (slurm.batch_partition), in a
    # lower PriorityTier: jobs of `partition` preempt (cancel) its jobs. "": none.
    batch_partition: str = ""
    # How slurmd tracks a job's processes: "auto" is proctrack/cgroup where the kernel allows
    # it (as real sites run, so a job's processes go with the job whatever they do), else
    # proctrack/linuxproc (parent links: a process whose parent exits is lost); "cgroup" or
    # "linuxproc" forces one.
    proctrack: str = "auto"
    # Slurm accounting (hpcserve/local_accounting.py): a MariaDB server and a slurmdbd of
    # this cluster's own, on ctld_port + nodes + 2 and ctld_port + nodes + 1, so that sacct
    # answers. Off by default: it costs ~100 MB of memory and seconds at start.
    accounting: bool = False
    # A switch topology (TopologyPlugin=topology/tree, topology.conf beside slurm.conf): every
    # node under one leaf switch of this name, as `scontrol show topology` then prints
    # (SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[1-2]). "": no topology plugin.
    leaf_switch: str = ""


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def preflight(accounting: bool = False) -> list[str]:
    """Problems that make a local cluster impossible on this machine; empty when fine.
    accounting: with slurmdbd and MariaDB (LocalSlurmSpec.accounting)."""
    problems: list[str] = []
    if accounting:
        missing_acct = [name for name in acct.BINARIES if _which(name) is None]
        if missing_acct:
            packages = sorted({acct.BINARIES[name] for name in missing_acct})
            problems.append(
                f"missing Slurm accounting programs: {', '.join(missing_acct)} (packages "
                f"{', '.join(packages)}; install with: {acct.APT_HINT})"
            )
    if os.geteuid() != 0:
        problems.append(
            "not running as root: slurmd must run as root to launch jobs, and munged is "
            "started under the munge user (run as root)"
        )
    missing = [name for name in _BINARIES if _which(name) is None]
    if missing:
        packages = sorted({_BINARIES[name] for name in missing})
        problems.append(
            f"missing Slurm/munge programs: {', '.join(missing)} "
            f"(packages {', '.join(packages)}; install with: {APT_HINT})"
        )
    if _which("munged") is not None:
        try:
            pwd.getpwnam("munge")
        except KeyError:
            problems.append(f"no 'munge' user (reinstall the munge package: {APT_HINT})")
    return problems


def short_hostname() -> str:
    try:
        out = subprocess.run(
            ["hostname", "-s"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or socket.gethostname().split(".")[0]


# ---------------------------------------------------------------- /proc helpers


def _read_proc(pid: int, name: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return None


def _cmdline(pid: int) -> list[str]:
    raw = _read_proc(pid, "cmdline") or b""
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _comm(pid: int) -> str:
    raw = _read_proc(pid, "comm")
    return raw.decode(errors="replace").strip() if raw else ""


def _stat_fields(pid: int) -> list[str]:
    raw = _read_proc(pid, "stat")
    if not raw:
        return []
    text = raw.decode(errors="replace")
    # "pid (comm) S ppid ...": comm may contain spaces, so split after the last ')'
    return text[text.rfind(")") + 2 :].split()


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (PID 1 may be slow to reap)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def _ppid(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[1]) if len(fields) > 1 else 0


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _env_has(pid: int, key: str, value: str) -> bool:
    raw = _read_proc(pid, "environ") or b""
    return f"{key}={value}".encode() in raw.split(b"\0")


def _descendants(roots: Iterable[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        children.setdefault(_ppid(pid), []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(pids: Iterable[int], deadline: float) -> set[int]:
    left = {p for p in pids if pid_alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if pid_alive(p)}
    return left


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_support(root: Path = CGROUP_ROOT) -> tuple[bool, str]:
    """Whether slurmd's proctrack/cgroup can work here, and why (or why not): it needs a
    freezer it can make cgroups in, cgroup v2's (cgroup.freeze) or v1's freezer hierarchy."""
    if (root / "cgroup.controllers").exists():
        where, what = root, "cgroup v2"
    elif (root / "freezer").is_dir():
        where, what = root / "freezer", "cgroup v1 (freezer)"
    else:
        return False, f"no cgroup freezer under {root} (neither cgroup v2 nor a v1 freezer)"
    probe = where / f"hpcserve-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as err:
        return False, f"{what} at {where} is not writable here ({err.strerror})"
    try:
        if what == "cgroup v2" and not (probe / "cgroup.freeze").exists():
            return False, "cgroup v2 without cgroup.freeze (kernel older than 5.2)"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return True, f"{what} at {where}"


def _port_free(port: int) -> bool:
    """Whether a daemon could listen on port (Slurm binds with SO_REUSEADDR, so do we)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"    (cannot read {path}: {exc})"
    return "\n".join("    " + line for line in text.splitlines()[-lines:]) or "    (empty)"


# ---------------------------------------------------------------- the cluster


class LocalSlurm:
    """Start/stop a slurmctld and `spec.nodes` slurmds whose files all live in `state_dir`."""

    def __init__(self, spec: LocalSlurmSpec):
        if spec.nodes < 1:
            raise ValueError("LocalSlurmSpec.nodes must be >= 1")
        if spec.gpus_per_node < 0 or spec.cpus_per_node < 1 or spec.memory_mb < 1:
            raise ValueError(f"invalid LocalSlurmSpec: {spec}")
        self.spec = spec
        self.state_dir = Path(spec.state_dir).absolute()
        self.node_names = [f"n{i}" for i in range(1, spec.nodes + 1)]
        if spec.proctrack not in ("auto", "cgroup", "linuxproc"):
            raise ValueError(f"LocalSlurmSpec.proctrack must be auto, cgroup or linuxproc: {spec}")
        self._proctrack: tuple[str, str] | None = None
        self.accounting = (
            acct.LocalAccounting(
                self.state_dir,
                self.state_dir,
                dbd_port=spec.ctld_port + spec.nodes + 1,
                db_port=spec.ctld_port + spec.nodes + 2,
                host=short_hostname(),
            )
            if spec.accounting
            else None
        )

    def proctrack(self) -> tuple[str, str]:
        """(ProctrackType, why): chosen once, logged once."""
        if self._proctrack is None:
            if self.spec.proctrack == "linuxproc":
                self._proctrack = ("proctrack/linuxproc", "asked for (LocalSlurmSpec.proctrack)")
            elif self.spec.proctrack == "cgroup":
                self._proctrack = ("proctrack/cgroup", "asked for (LocalSlurmSpec.proctrack)")
            else:
                usable, why = cgroup_support()
                self._proctrack = ("proctrack/cgroup" if usable else "proctrack/linuxproc", why)
            log.info("local cluster %s: %s: %s", self.state_dir, *self._proctrack)
        return self._proctrack

    @property
    def first_job_id(self) -> int:
        """proctrack/cgroup names a job's cgroup after its node and id (slurm_n1/uid_0/job_N),
        and every local cluster has nodes n1, n2...: so each cluster takes its own job ids,
        JOB_IDS_PER_CLUSTER of them from ctld_port x JOB_IDS_PER_CLUSTER (below Slurm's
        MaxJobId for any port), never those of another cluster on the machine."""
        return self.spec.ctld_port * JOB_IDS_PER_CLUSTER + 1

    # -- paths and environment
    @property
    def conf_path(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def gres_conf_path(self) -> Path:
        return self.state_dir / "gres.conf"

    @property
    def ctld_log(self) -> Path:
        return self.state_dir / "slurmctld.log"

    def slurmd_log(self, node: str) -> Path:
        return self.state_dir / f"slurmd-{node}.log"

    def _ctld_pid_file(self) -> Path:
        return self.state_dir / "slurmctld.pid"

    def _slurmd_pid_file(self, node: str) -> Path:
        return self.state_dir / f"slurmd-{node}.pid"

    def _gpu_files(self, node: str) -> list[Path]:
        return [
            self.state_dir / "fakegpu" / node / f"gpu{i}" for i in range(self.spec.gpus_per_node)
        ]

    def env(self) -> dict[str, str]:
        """os.environ with SLURM_CONF pointing at this cluster (for every client command)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    # -- configuration
    def render_config(self) -> tuple[str, str]:
        """(slurm.conf, gres.conf) text for this spec."""
        s, d = self.spec, self.state_dir
        host = short_hostname()
        lines = [
            "# Written by hpcserve.localslurm; regenerated on every start().",
            "ClusterName=hpcserve",
            # the name must be this host's short name (slurmctld checks it); the address in
            # parentheses is what clients and slurmds connect to, so no DNS is needed
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={s.ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            # proctrack/cgroup where the kernel allows it (cgroup.conf beside this file)
            f"ProctrackType={self.proctrack()[0]}",
            f"FirstJobId={self.first_job_id}",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "SchedulerType=sched/backfill",
            # jobs start within ~1 s (median ~0.3 s): no batching delay for batch jobs, and
            # the main and backfill loops run every second instead of every 60/30 s; most
            # submissions are started by that 1-s backfill pass, and a pending job gets its
            # real reason ("Resources" instead of the first "Priority") within a second
            "SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # every slurmd sees the whole machine; trust slurm.conf's CPUs/RealMemory instead
            # of marking the node INVAL when the host has fewer CPUs or less memory
            "SlurmdParameters=config_overrides",
            # a node that was DOWN comes back as soon as its slurmd registers
            "ReturnToService=2",
            # finished jobs stay visible in squeue for a minute (there is no accounting db)
            "MinJobAge=60",
            # seconds between SIGTERM and SIGKILL when a job is cancelled or times out
            "KillWait=10",
            "GresTypes=gpu",
        ]
        if self.accounting is not None:
            lines += self.accounting.slurm_conf_lines()
        if s.leaf_switch:
            lines.append("TopologyPlugin=topology/tree")  # reads topology.conf beside this
        gres_lines = ["# Written by hpcserve.localslurm: plain files stand in for GPUs."]
        for i, node in enumerate(self.node_names, start=1):
            gres = f" Gres=gpu:{s.gpus_per_node}" if s.gpus_per_node else ""
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={s.ctld_port + i}"
                f" CPUs={s.cpus_per_node} RealMemory={s.memory_mb}{gres} State=UNKNOWN"
            )
            if s.gpus_per_node:
                last = s.gpus_per_node - 1
                gres_lines.append(f"NodeName={node} Name=gpu File={d}/fakegpu/{node}/gpu[0-{last}]")
        tier = ""
        if s.batch_partition:
            lines += ["PreemptType=preempt/partition_prio", "PreemptMode=CANCEL"]
            tier = " PriorityTier=2"
        lines.append(
            f"PartitionName={s.partition} Nodes={','.join(self.node_names)} Default=YES"
            f" MaxTime=INFINITE State=UP{tier}"
        )
        if s.batch_partition:
            lines.append(
                f"PartitionName={s.batch_partition} Nodes={','.join(self.node_names)}"
                " MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL"
            )
        return "\n".join(lines) + "\n", "\n".join(gres_lines) + "\n"

    def _write_config(self) -> bool:
        """Write the config files; True when slurm.conf or gres.conf changed."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "state").mkdir(exist_ok=True)
        for node in self.node_names:
            (self.state_dir / f"spool-{node}").mkdir(exist_ok=True)
            for f in self._gpu_files(node):
                f.parent.mkdir(parents=True, exist_ok=True)
                f.touch(exist_ok=True)
        slurm_conf, gres_conf = self.render_config()
        changed = False
        files = [(self.conf_path, slurm_conf), (self.gres_conf_path, gres_conf)]
        files.append((self.state_dir / "cgroup.conf", CGROUP_CONF))
        if self.spec.leaf_switch:
            nodes = ",".join(self.node_names)
            topology = f"SwitchName={self.spec.leaf_switch} Nodes={nodes}\n"
            files.append((self.state_dir / "topology.conf", topology))
        for path, text in files:
            try:
                same = path.read_text() == text
            except OSError:
                same = False
            if not same:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(path)
                changed = True
        return changed

    # -- daemon bookkeeping
    def _daemon_pid(self, pid_file: Path, binary: str, node: str | None = None) -> int | None:
        """The live pid recorded in pid_file if it is really our daemon, else None."""
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        if not pid_alive(pid):
            return None
        argv = _cmdline(pid)
        if not argv or Path(argv[0]).name != binary or str(self.conf_path) not in argv:
            return None
        if node is not None and node not in argv:
            return None
        return pid

    def _ctld_pid(self) -> int | None:
        return self._daemon_pid(self._ctld_pid_file(), "slurmctld")

    def _slurmd_pid(self, node: str) -> int | None:
        return self._daemon_pid(self._slurmd_pid_file(node), "slurmd", node)

    def _our_daemon_pids(self) -> set[int]:
        """Every live slurmctld/slurmd started with this conf (pid files or not)."""
        conf = str(self.conf_path)
        found = set()
        for pid in _all_pids():
            argv = _cmdline(pid)
            if (
                argv
                and Path(argv[0]).name in ("slurmctld", "slurmd")
                and conf in argv
                and pid_alive(pid)
            ):
                found.add(pid)
        return found

    def _our_stepds(self) -> set[int]:
        """slurmstepd processes of this cluster (they inherit SLURM_CONF from our slurmd)."""
        conf = str(self.conf_path)
        return {
            pid
            for pid in _all_pids()
            if _comm(pid) == "slurmstepd" and pid_alive(pid) and _env_has(pid, "SLURM_CONF", conf)
        }

    def _our_job_processes(self) -> set[int]:
        """Live processes with this cluster's SLURM_CONF and a SLURM_JOB_ID: a job's."""
        conf = f"SLURM_CONF={self.conf_path}".encode()
        found = set()
        for pid in _all_pids():
            environ = (_read_proc(pid, "environ") or b"").split(b"\0")
            job = conf in environ and any(e.startswith(b"SLURM_JOB_ID=") for e in environ)
            if job and pid != os.getpid() and pid_alive(pid):
                found.add(pid)
        return found

    def _our_cgroup_processes(self) -> set[int]:
        """Live processes in a job cgroup of this cluster (proctrack/cgroup): its node names
        and a job id of its range. Whatever they did (renamed themselves, blanked their
        environment, left the session, lost their parent), they cannot leave it."""
        first = self.first_job_id
        nodes = tuple(f"/slurm_{node}/" for node in self.node_names)
        found = set()
        for pid in _all_pids():
            text = (_read_proc(pid, "cgroup") or b"").decode(errors="replace")
            for line in text.splitlines():
                path = line.split(":", 2)[-1] + "/"
                if not any(node in path for node in nodes) or "/job_" not in path:
                    continue
                job = path.split("/job_", 1)[1].split("/", 1)[0]
                if job.isdigit() and first <= int(job) < first + JOB_IDS_PER_CLUSTER:
                    if pid != os.getpid() and pid_alive(pid):
                        found.add(pid)
                    break
        return found

    def _kill_strays(self, deadline: float) -> set[int]:
        """What the scans in stop() missed: a job launched as the daemons stopped (its stepd
        not started yet when they looked), or a job process whose stepd lost track of it
        (proctrack/linuxproc follows parent links). Killed until none is left; those that
        survive SIGKILL until `deadline` are returned."""
        strays = self._strays()
        while strays and time.monotonic() < deadline:
            tree = strays | _descendants(strays)
            log.warning("killing stray processes of %s: %s", self.state_dir, sorted(tree))
            _signal(tree, signal.SIGKILL)
            if _wait_gone(tree, deadline):
                break
            strays = self._strays()
        return {p for p in strays if pid_alive(p)}

    def _strays(self) -> set[int]:
        return (
            self._our_daemon_pids()
            | self._our_stepds()
            | self._our_job_processes()
            | self._our_cgroup_processes()
        )

    def is_running(self) -> bool:
        """True when slurmctld and every slurmd of this cluster are alive."""
        return self._ctld_pid() is not None and all(
            self._slurmd_pid(n) is not None for n in self.node_names
        )

    def _client(self, argv: list[str], timeout: float = 5) -> subprocess.CompletedProcess[str]:
        """Run a client command against this cluster; a timeout becomes rc 124, not an error."""
        try:
            return subprocess.run(
                argv, capture_output=True, text=True, env=self.env(), timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout} s")

    def _fail(self, what: str, log_path: Path, extra: str = "") -> LocalSlurmError:
        msg = f"{what}; see {log_path}, last lines:\n{_tail(log_path)}"
        if extra:
            msg += f"\n{extra}"
        return LocalSlurmError(msg)

    # -- munge
    def _munge_ok(self) -> bool:
        try:
            res = subprocess.run(
                [_which("munge") or "munge", "-n"], capture_output=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return res.returncode == 0

    def _ensure_munge(self) -> None:
        if self._munge_ok():
            return
        munge_user = pwd.getpwnam("munge")
        if not MUNGE_KEY.exists():
            log.info("creating the munge key %s (mungekey -c)", MUNGE_KEY)
            subprocess.run(
                [_which("mungekey") or "mungekey", "-c"], check=True, capture_output=True
            )
            os.chown(MUNGE_KEY, munge_user.pw_uid, munge_user.pw_gid)
            MUNGE_KEY.chmod(0o600)
        MUNGE_RUN_DIR.mkdir(parents=True, exist_ok=True)
        os.chown(MUNGE_RUN_DIR, munge_user.pw_uid, munge_user.pw_gid)
        munged = _which("munged") or "/usr/sbin/munged"
        others = [p for p in _all_pids() if _comm(p) == "munged" and pid_alive(p)]
        # --force only when no munged runs at all: it clears a stale socket lock of a dead one
        argv = ["runuser", "-u", "munge", "--", munged] + ([] if others else ["--force"])
        res = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        deadline = time.monotonic() + 10
        while not self._munge_ok():
            if time.monotonic() > deadline:
                raise self._fail(
                    f"munged did not start ({' '.join(argv)} -> rc {res.returncode}, "
                    f"stderr {res.stderr.strip()!r})",
                    MUNGE_LOG,
                )
            time.sleep(0.1)
        try:
            pid = int(MUNGE_PID_FILE.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        (self.state_dir / _OWNER_FILE).write_text(f"{pid}\n")
        log.info("started munged (pid %s); this cluster will stop it again", pid)

    def _stop_munge_if_ours(self, deadline: float) -> None:
        owner = self.state_dir / _OWNER_FILE
        if not owner.exists():
            return
        try:
            pid = int(owner.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = 0
        others = [p for p in _all_pids() if _comm(p) in ("slurmctld", "slurmd") and pid_alive(p)]
        if pid and _comm(pid) == "munged" and pid_alive(pid):
            if others:
                log.warning(
                    "leaving munged (pid %d, started by this cluster) running: other Slurm "
                    "daemons on this machine use it (pids %s)",
                    pid,
                    others,
                )
            else:
                _signal([pid], signal.SIGTERM)
                if _wait_gone([pid], deadline):
                    _signal([pid], signal.SIGKILL)
                    _wait_gone([pid], time.monotonic() + 2)
        owner.unlink(missing_ok=True)

    # -- start / stop
    def start(self, timeout: float = 60) -> None:
        """Write the config, ensure munged, start slurmctld and the slurmds, wait for the nodes.

        Idempotent: daemons already running are kept (they are restarted only when the
        config changed). Raises LocalSlurmError naming the log file of a failing daemon.
        """
        problems = preflight(self.spec.accounting)
        if problems:
            raise LocalSlurmError(
                "cannot run a local Slurm cluster here:\n- " + "\n- ".join(problems)
            )
        deadline = time.monotonic() + timeout
        self._check_paths()
        running = self._our_daemon_pids()
        changed = self._write_config()
        if changed and running:
            log.info("slurm.conf changed; restarting the local cluster in %s", self.state_dir)
            self.stop()
        try:
            self._start_daemons(deadline)
        except BaseException as exc:
            # a half-started cluster is useless: leave nothing running (the logs stay)
            try:
                self.stop()
            except LocalSlurmError as stop_exc:
                log.warning("cleanup after the failed start: %s", stop_exc)
            if not (
                isinstance(exc, LocalSlurmError)
                and self.spec.proctrack == "auto"
                and self.proctrack()[0] == "proctrack/cgroup"
            ):
                raise
            first_line = str(exc).splitlines()[0]
            self._proctrack = (
                "proctrack/linuxproc",
                f"the daemons did not start with proctrack/cgroup ({first_line})",
            )
            log.warning("local cluster %s: %s: %s", self.state_dir, *self._proctrack)
            self._write_config()
            try:
                self._start_daemons(max(deadline, time.monotonic() + timeout / 2))
            except BaseException:
                try:
                    self.stop()
                except LocalSlurmError as stop_exc:
                    log.warning("cleanup after the failed start: %s", stop_exc)
                raise

    def _ports(self) -> list[tuple[int, str]]:
        """(port, daemon) pairs: slurmctld on ctld_port, slurmd ni on ctld_port + i."""
        return [(self.spec.ctld_port, "slurmctld")] + [
            (self.spec.ctld_port + i, node) for i, node in enumerate(self.node_names, start=1)
        ]

    def _check_paths(self) -> None:
        # slurmd/slurmstepd put Unix sockets named <host>_<job>.<step> in the spool dirs;
        # a socket path has at most 107 bytes
        longest = max(len(f"{self.state_dir}/spool-{n}") for n in self.node_names)
        longest += len(f"/{short_hostname()}_4294967294.4294967294")
        if longest > 107:
            raise LocalSlurmError(
                f"state_dir {self.state_dir} is too deep: slurmd's socket paths under it would "
                f"be {longest} bytes long (at most 107); choose a shorter state_dir"
            )

    def _start_daemons(self, deadline: float) -> None:
        self._ensure_munge()
        env = self.env()
        running = self._running_daemons()
        started_ctld = "slurmctld" not in running
        wanted = [(p, n) for p, n in self._ports() if n not in running]
        busy = [f"{port} ({name})" for port, name in wanted if not _port_free(port)]
        if busy:
            raise LocalSlurmError(
                f"ports in use: {', '.join(busy)}; another cluster (or service) listens there. "
                f"Choose another LocalSlurmSpec.ctld_port (slurmd i uses ctld_port + i)"
            )
        if self.accounting is not None:
            try:
                self.accounting.start(env, deadline)
                self.accounting.add_cluster(env, "hpcserve")
            except acct.LocalAccountingError as exc:
                raise LocalSlurmError(str(exc)) from exc
        if started_ctld:
            self._run_daemon(
                [_which("slurmctld") or "slurmctld", "-f", str(self.conf_path)],
                env,
                self.ctld_log,
                "slurmctld",
            )
        self._wait_ctld(deadline)
        for node in self.node_names:
            if node not in running:
                self._run_daemon(
                    [_which("slurmd") or "slurmd", "-f", str(self.conf_path), "-N", node],
                    env,
                    self.slurmd_log(node),
                    f"slurmd {node}",
                )
        self._wait_nodes(deadline, resume_stale=started_ctld)

    def _run_daemon(self, argv: list[str], env: dict[str, str], log_path: Path, what: str) -> None:
        try:
            res = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=env,
                timeout=30,
                check=False,
                cwd=self.state_dir,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as exc:
            raise self._fail(f"{what} did not daemonize within 30 s", log_path) from exc
        if res.returncode != 0:
            out = (res.stderr + res.stdout).strip()
            raise self._fail(
                f"{what} failed to start ({' '.join(argv)} -> rc {res.returncode})",
                log_path,
                f"its output: {out!r}" if out else "",
            )

    def _running_daemons(self) -> dict[str, int]:
        """{"slurmctld" or node name: pid} of live daemons with our conf, found in /proc.

        Unlike the pid files this sees a daemon that has forked but not yet written its pid.
        """
        found: dict[str, int] = {}
        for pid in self._our_daemon_pids():
            argv = _cmdline(pid)
            if Path(argv[0]).name == "slurmctld":
                found["slurmctld"] = pid
            elif "-N" in argv and argv.index("-N") + 1 < len(argv):
                found[argv[argv.index("-N") + 1]] = pid
        return found

    def _check_alive(self, nodes: bool = True) -> None:
        running = self._running_daemons()
        if "slurmctld" not in running:
            raise self._fail("slurmctld is not running (it exited)", self.ctld_log)
        for node in self.node_names if nodes else []:
            if node not in running:
                raise self._fail(f"slurmd {node} is not running (it exited)", self.slurmd_log(node))

    def _wait_ctld(self, deadline: float) -> None:
        last = ""
        while True:
            self._check_alive(nodes=False)
            res = self._client([_which("scontrol") or "scontrol", "ping"])
            last = (res.stdout + res.stderr).strip()
            if res.returncode == 0 and "is UP" in res.stdout:
                return
            if time.monotonic() > deadline:
                raise self._fail(
                    f"slurmctld did not answer `scontrol ping` in time (last: {last!r})",
                    self.ctld_log,
                )
            time.sleep(0.1)

    def node_states(self) -> dict[str, str]:
        """{node: sinfo %T state} (e.g. idle, mixed, drained, down*); empty if unreachable."""
        res = self._client([_which("sinfo") or "sinfo", "-h", "-N", "-o", "%N|%T"])
        if res.returncode != 0:
            return {}
        states = {}
        for line in res.stdout.splitlines():
            name, _, state = line.strip().partition("|")
            if name:
                states[name] = state
        return states

    def _wait_nodes(self, deadline: float, *, resume_stale: bool) -> None:
        resumed = False
        states: dict[str, str] = {}
        while True:
            states = self.node_states()
            if states and all(states.get(n) in _USABLE_STATES for n in self.node_names):
                return
            if resume_stale and not resumed and states:
                # a fresh slurmctld recovers node state: a drain left by an earlier session
                # would keep the node out forever, so a start gives every node back
                stale = [
                    n
                    for n in self.node_names
                    if any(w in states.get(n, "") for w in ("drain", "down", "fail"))
                    and not states.get(n, "").endswith("*")
                ]
                if stale:
                    log.info("resuming nodes left drained/down by an earlier run: %s", stale)
                    self._client(
                        [
                            _which("scontrol") or "scontrol",
                            "update",
                            f"nodename={','.join(stale)}",
                            "state=resume",
                        ]
                    )
                resumed = True
            self._check_alive()
            if time.monotonic() > deadline:
                bad = {n: states.get(n, "?") for n in self.node_names}
                worst = next(
                    (n for n in self.node_names if states.get(n) not in _USABLE_STATES),
                    self.node_names[0],
                )
                raise self._fail(
                    f"nodes not idle in time: {bad}",
                    self.slurmd_log(worst),
                    f"slurmctld log ({self.ctld_log}):\n{_tail(self.ctld_log, 8)}",
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 20) -> None:
        """Cancel every job, stop this cluster's daemons, leave no process of it behind."""
        deadline = time.monotonic() + timeout
        if self._ctld_pid() is not None:
            self._cancel_all_jobs(deadline - 4)
        # the pid files name the daemons; the /proc scan also finds one whose file is gone
        daemons = self._our_daemon_pids()
        daemons |= {p for p in [self._ctld_pid()] if p is not None}
        daemons |= {p for p in map(self._slurmd_pid, self.node_names) if p is not None}
        _signal(daemons, signal.SIGTERM)
        left = _wait_gone(daemons, max(deadline - 1, time.monotonic() + 1))
        if left:
            log.warning("Slurm daemons %s ignored SIGTERM; killing them", sorted(left))
            _signal(left, signal.SIGKILL)
            left = _wait_gone(left, time.monotonic() + 3)
        # job steps outlive slurmd; kill any left over, together with their process trees
        stepds = self._our_stepds()
        if stepds:
            tree = stepds | _descendants(stepds)
            log.warning("killing leftover job processes of %s: %s", self.state_dir, sorted(tree))
            _signal(tree, signal.SIGKILL)
            left |= _wait_gone(tree, time.monotonic() + 3)
        left |= self._kill_strays(time.monotonic() + 5)
        if self.accounting is not None:
            left |= set(self.accounting.stop())
        self._stop_munge_if_ours(max(deadline, time.monotonic() + 2))
        for pid_file in [self._ctld_pid_file()] + [
            self._slurmd_pid_file(n) for n in self.node_names
        ]:
            pid_file.unlink(missing_ok=True)
        if left:
            raise LocalSlurmError(
                f"processes of the local cluster in {self.state_dir} survived SIGKILL: "
                f"{sorted(left)}"
            )

    def _cancel_all_jobs(self, deadline: float) -> None:
        res = self._client([_which("squeue") or "squeue", "-h", "-o", "%i"])
        ids = [line.strip() for line in res.stdout.splitlines() if line.strip()]
        if ids:
            self._client([_which("scancel") or "scancel", *ids])
        # wait for the job steps to end (SIGTERM, then SIGKILL after KillWait), and for
        # slurmctld to hear of it (a job still COMPLETING is restored so at the next start)
        while self._our_stepds() and time.monotonic() < deadline:
            time.sleep(0.1)
        while ids and time.monotonic() < deadline:
            res = self._client([_which("squeue") or "squeue", "-h", "-o", "%i"])
            if res.returncode != 0 or not res.stdout.strip():
                break
            time.sleep(0.1)


__all__ = [
    "APT_HINT",
    "LocalSlurm",
    "LocalSlurmError",
    "LocalSlurmSpec",
    "preflight",
    "short_hostname",
]
