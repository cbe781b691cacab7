"""Slurm accounting for a local cluster (hpcserve/localslurm.py): its own MariaDB server
and slurmdbd, so that `sacct` answers as on a site that runs slurmdbd.

Everything lives under `<state_dir>/accounting`: MariaDB's data directory, socket, pid and
log files; slurmdbd's config sits beside slurm.conf (slurmdbd has no -f: it reads
`slurmdbd.conf` from SLURM_CONF's directory) with its pid and log files. MariaDB listens on
127.0.0.1 only, for one user made here with a random password (in slurmdbd.conf, 0600:
loopback is shared with every user of the host); root reaches it by its socket alone.

Requires Debian's `slurmdbd mariadb-server` packages (scripts/bootstrap.sh installs them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

APT_HINT = "apt-get install slurmdbd mariadb-server"
BINARIES = {
    "slurmdbd": "slurmdbd",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-client",
}
DATABASE = "slurm_acct_db"
DB_USER = "slurm"
# Small: a test cluster's accounting, not a site's (the defaults take ~100 MB on disk).
_MARIADB_OPTIONS = (
    "--no-defaults",
    "--skip-name-resolve",
    "--skip-log-bin",
    "--innodb-log-file-size=8M",
    "--innodb-buffer-pool-size=32M",
)


class LocalAccountingError(RuntimeError):
    """MariaDB or slurmdbd did not start; the message names the log to read."""


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"    (cannot read {path}: {exc})"
    return "\n".join("    " + line for line in text.splitlines()[-lines:]) or "    (empty)"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X", "")


def _pid_in(path: Path, marker: str) -> int | None:
    """The live pid recorded in `path` whose command line or environment names `marker`."""
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _alive(pid):
        return None
    try:
        seen = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return pid if marker.encode() in seen else None


class LocalAccounting:
    """MariaDB + slurmdbd for the cluster whose config is `conf_dir/slurm.conf`.

    dbd_port: slurmdbd's port; db_port: MariaDB's (127.0.0.1). host: this host's short name
    (slurmdbd checks DbdHost against it)."""

    def __init__(
        self, state_dir: Path, conf_dir: Path, *, dbd_port: int, db_port: int, host: str
    ) -> None:
        self.dir = state_dir / "accounting"
        self.conf_dir = conf_dir
        self.dbd_port = dbd_port
        self.db_port = db_port
        self.host = host
        self._db_process: subprocess.Popen[bytes] | None = None

    @property
    def datadir(self) -> Path:
        return self.dir / "mariadb"

    @property
    def socket(self) -> Path:
        return self.dir / "mysqld.sock"

    @property
    def db_log(self) -> Path:
        return self.dir / "mariadb.log"

    @property
    def dbd_log(self) -> Path:
        return self.dir / "slurmdbd.log"

    @property
    def dbd_conf(self) -> Path:
        return self.conf_dir / "slurmdbd.conf"

    def slurm_conf_lines(self) -> list[str]:
        """What slurm.conf needs to send its jobs' records to this slurmdbd."""
        return [
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.dbd_port}",
            # GPUs counted in each job's AllocTRES (sacct), as sites with GPUs configure it
            "AccountingStorageTRES=gres/gpu",
        ]

    # -- start
    def start(self, env: Mapping[str, str], deadline: float) -> None:
        """MariaDB (its data directory made on the first start), then slurmdbd; both kept
        when already running. env: the cluster's (SLURM_CONF)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        password = self._password()
        if self._db_pid() is None:
            self._start_mariadb(password, deadline)
        self._write_dbd_conf(password)
        if self._dbd_pid() is None:
            self._start_slurmdbd(env, deadline)

    def _password(self) -> str:
        path = self.dir / "db-password"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            password = secrets.token_hex(16)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
            return password

    def _start_mariadb(self, password: str, deadline: float) -> None:
        fresh = not (self.datadir / "mysql").is_dir()
        if fresh:
            self.datadir.mkdir(mode=0o700, parents=True, exist_ok=True)
            res = subprocess.run(
                [
                    "mariadb-install-db",
                    *_MARIADB_OPTIONS,
                    f"--datadir={self.datadir}",
                    "--user=root",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                capture_output=True,
                text=True,
                timeout=max(30.0, deadline - time.monotonic()),
                check=False,
            )
            if res.returncode != 0:
                raise LocalAccountingError(
                    f"mariadb-install-db failed (rc {res.returncode}): "
                    f"{(res.stderr or res.stdout).strip()[-1500:]!r}"
                )
        with open(self.db_log, "ab") as out:
            # mariadbd does not fork into the background: kept, to be reaped at stop()
            self._db_process = subprocess.Popen(
                [
                    "/usr/sbin/mariadbd",
                    *_MARIADB_OPTIONS,
                    f"--datadir={self.datadir}",
                    f"--socket={self.socket}",
                    f"--port={self.db_port}",
                    "--bind-address=127.0.0.1",
                    f"--pid-file={self.dir / 'mariadb.pid'}",
                    f"--log-error={self.db_log}",
                    "--user=root",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        while self._sql("SELECT 1").returncode != 0:
            if time.monotonic() > deadline:
                raise LocalAccountingError(
                    f"MariaDB did not answer on {self.socket} in time; see {self.db_log}:\n"
                    + _tail(self.db_log)
                )
            time.sleep(0.2)
        # Every start: the user exists with the password of the file (made again if lost).
        grant = (
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{password}'; "
            f"ALTER USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{password}'; "
            f"GRANT ALL ON {DATABASE}.* TO '{DB_USER}'@'127.0.0.1';"
        )
        res = self._sql(grant)
        if res.returncode != 0:
            raise LocalAccountingError(f"cannot make the slurmdbd database user: {res.stderr!r}")
        log.info("MariaDB for Slurm accounting on 127.0.0.1:%d (%s)", self.db_port, self.datadir)

    def _sql(self, statements: str) -> subprocess.CompletedProcess[str]:
        """Statements as root over the socket; the SQL goes on stdin, never in argv."""
        try:
            return subprocess.run(
                ["mariadb", "--no-defaults", f"--socket={self.socket}", "-u", "root"],
                input=statements,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess([], 124, "", "timed out")

    def _write_dbd_conf(self, password: str) -> None:
        text = "\n".join(
            [
                "# Written by hpcserve.local_accounting.",
                "AuthType=auth/munge",
                f"DbdHost={self.host}",
                "DbdAddr=127.0.0.1",
                f"DbdPort={self.dbd_port}",
                "SlurmUser=root",
                f"PidFile={self.dir / 'slurmdbd.pid'}",
                f"LogFile={self.dbd_log}",
                "StorageType=accounting_storage/mysql",
                "StorageHost=127.0.0.1",
                f"StoragePort={self.db_port}",
                f"StorageUser={DB_USER}",
                f"StoragePass={password}",
                f"StorageLoc={DATABASE}",
                "",
            ]
        )
        # slurmdbd refuses a config that others can read (it holds the password)
        fd = os.open(self.dbd_conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(self.dbd_conf, 0o600)

    def _start_slurmdbd(self, env: Mapping[str, str], deadline: float) -> None:
        res = subprocess.run(
            ["/usr/sbin/slurmdbd"],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            cwd=self.dir,
            start_new_session=True,
        )
        if res.returncode != 0:
            raise LocalAccountingError(
                f"slurmdbd failed to start (rc {res.returncode}): {res.stderr.strip()!r}; "
                f"see {self.dbd_log}:\n{_tail(self.dbd_log)}"
            )
        # It answers once it made its tables: sacctmgr then registers the cluster (as an
        # admin would; slurmctld would add it itself, but only at its next registration).
        while True:
            res = subprocess.run(
                ["sacctmgr", "-i", "-n", "list", "cluster", "format=cluster"],
                env=dict(env),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if res.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise LocalAccountingError(
                    f"slurmdbd did not answer sacctmgr in time ({res.stderr.strip()!r}); see "
                    f"{self.dbd_log}:\n{_tail(self.dbd_log)}"
                )
            time.sleep(0.3)
        log.info("slurmdbd on 127.0.0.1:%d", self.dbd_port)

    def add_cluster(self, env: Mapping[str, str], name: str) -> None:
        res = subprocess.run(
            ["sacctmgr", "-i", "-n", "list", "cluster", "format=cluster"],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if name in res.stdout.split():
            return
        res = subprocess.run(
            ["sacctmgr", "-i", "add", "cluster", name],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if res.returncode != 0:
            raise LocalAccountingError(
                f"sacctmgr add cluster {name} failed: {(res.stderr or res.stdout).strip()!r}"
            )

    # -- stop
    def _db_pid(self) -> int | None:
        return _pid_in(self.dir / "mariadb.pid", str(self.datadir))

    def _dbd_pid(self) -> int | None:
        return _pid_in(self.dir / "slurmdbd.pid", f"SLURM_CONF={self.conf_dir / 'slurm.conf'}")

    def stop(self, timeout: float = 20) -> list[int]:
        """slurmdbd, then MariaDB; the pids that survived SIGKILL (none, normally)."""
        left = []
        for pid in (self._dbd_pid(), self._db_pid()):
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                log.warning("pid %d ignored SIGTERM; killing it", pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _alive(pid):
                    left.append(pid)
        if self._db_process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._db_process.wait(5)
            if self._db_process.poll() is not None:
                self._db_process = None
        return left


__all__ = ["APT_HINT", "BINARIES", "LocalAccounting", "LocalAccountingError"]
