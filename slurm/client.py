"""The one client through which all of hpcserve reaches Slurm.

`SlurmCLI` drives Slurm's command-line tools (sbatch, squeue, scancel, scontrol, sinfo),
which work across releases; their `--json` output is read by `slurm_parse`. Every call is an
argv list (never a shell string), has a timeout, and is counted in `SlurmCLI.calls` so tests
can assert e.g. one squeue per poll. A pyslurm backend could sit behind the same
`SlurmClient` protocol for sites whose libslurm matches pyslurm's release; none exists yet,
and `make_slurm_client(prefer_pyslurm=True)` says so in one warning and returns the CLI.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from hpcserve.slurm.parse import (
    SACCT_FIELDS,
    AccountedJob,
    SlurmNode,
    SlurmParseError,
    SqueueSnapshot,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_show_node_json,
    parse_scontrol_show_topology,
    parse_squeue_json,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
Runner = Callable[[list[str], "str | None"], "subprocess.CompletedProcess[str]"]
_QUOTE_LIMIT = 2000
# scancel's complaints about jobs that are already gone: a race with the job ending, not a fault
_GONE = re.compile(
    r"(Invalid job id specified|already completing or completed|Job has already finished)", re.I
)


def _quote(text: str) -> str:
    text = text.strip()
    if len(text) > _QUOTE_LIMIT:
        text = "..." + text[-_QUOTE_LIMIT:]
    return repr(text)


class SlurmError(Exception):
    """A Slurm command failed; the message has the argv and Slurm's own output, quoted."""

    def __init__(
        self,
        message: str,
        *,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ):
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        parts = [message]
        if argv:
            parts.append(f"command: {shlex.join(self.argv)}")
        if returncode is not None:
            parts.append(f"exit status: {returncode}")
        if stderr.strip():
            parts.append(f"stderr: {_quote(stderr)}")
        if stdout.strip():
            parts.append(f"stdout: {_quote(stdout)}")
        super().__init__("; ".join(parts))

    @classmethod
    def failed(
        cls, message: str, argv: Sequence[str], res: subprocess.CompletedProcess[str]
    ) -> SlurmError:
        return cls(
            message,
            argv=argv,
            returncode=res.returncode,
            stdout=res.stdout or "",
            stderr=res.stderr or "",
        )


@runtime_checkable
class SlurmClient(Protocol):
    def submit(self, script: str, *, extra_args: Sequence[str] = ()) -> int: ...

    def jobs(self, *, name_prefix: str | None = None) -> SqueueSnapshot: ...

    def cancel(
        self, job_ids: Sequence[int], *, signal: str | None = None, batch_only: bool = False
    ) -> None: ...

    def nodes(self) -> list[SlurmNode]: ...

    def drain_node(self, node: str, reason: str) -> None: ...

    def resume_node(self, node: str) -> None: ...

    def release(self) -> str: ...

    def topology(self) -> dict[str, str]: ...


class SlurmCLI:
    """SlurmClient on Slurm's command-line tools.

    env: the environment of every command (SLURM_CONF picks the cluster); None means
    os.environ. runner(argv, stdin) replaces subprocess.run (tests pass a fake); the default
    one applies env and timeout_s.
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        timeout_s: float = 30,
        runner: Runner | None = None,
    ):
        self.env = dict(os.environ if env is None else env)
        # sacct prints times as Unix seconds (parse_sacct); the --json outputs of the other
        # commands are not affected by it.
        self.env["SLURM_TIME_FORMAT"] = "%s"
        self.timeout_s = timeout_s
        self._runner = runner or self._subprocess_runner
        self.calls: collections.Counter[str] = collections.Counter()
        self._release: str | None = None
        self._nodes_argv: list[str] | None = None

    def _subprocess_runner(
        self, argv: list[str], stdin: str | None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=self.timeout_s,
            check=False,
        )

    def _run(
        self, argv: list[str], stdin: str | None = None, *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        self.calls[argv[0]] += 1
        try:
            res = self._runner(argv, stdin)
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(
                f"Slurm command did not finish within {self.timeout_s:g} s (slurmctld busy or "
                "unreachable?); raise SlurmCLI(timeout_s=...) if it is just slow",
                argv=argv,
                stdout=_text(exc.stdout),
                stderr=_text(exc.stderr),
            ) from exc
        except OSError as exc:
            raise SlurmError(
                f"cannot run {argv[0]} ({exc}); is slurm-client installed and on PATH?",
                argv=argv,
            ) from exc
        if check and res.returncode != 0:
            raise SlurmError.failed(f"{argv[0]} failed", argv, res)
        return res

    # -- jobs
    def submit(self, script: str, *, extra_args: Sequence[str] = ()) -> int:
        """sbatch the script (passed on stdin); extra_args go before it, e.g. ["--hold"]."""
        argv = ["sbatch", "--parsable", *extra_args]
        return _parsed(argv, self._run(argv, script), parse_sbatch_parsable, "the job id")

    def test_submit(self, script: str, *, extra_args: Sequence[str] = ()) -> str:
        """`sbatch --test-only`: would Slurm take this job (nothing is submitted)? Returns
        Slurm's answer ("Job 12 to start at ... using 1 processors on nodes n1 in partition
        gpu"); raises SlurmError with Slurm's own words when it would refuse it."""
        res = self._run(["sbatch", "--test-only", *extra_args], script)
        return " ".join((res.stderr or res.stdout).replace("sbatch: ", "").split())

    def jobs(self, *, name_prefix: str | None = None) -> SqueueSnapshot:
        """Every job slurmctld still remembers (all users, all partitions, finished ones
        until MinJobAge), in ONE squeue call; name_prefix filters here, not in Slurm."""
        argv = ["squeue", "--all", "--json"]
        snap = _parsed(argv, self._run(argv), parse_squeue_json, "squeue's output")
        if snap.release:
            self._release = snap.release
        if name_prefix is not None:
            snap = SqueueSnapshot(
                release=snap.release,
                jobs=[j for j in snap.jobs if j.name.startswith(name_prefix)],
            )
        return snap

    def cancel(
        self, job_ids: Sequence[int], *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        """One scancel for all ids. signal="USR1", batch_only=True -> `scancel --signal=USR1
        --batch` (only the batch shell gets it). Ids of jobs that already ended are ignored."""
        if batch_only and signal is None:
            raise ValueError("batch_only needs a signal (it signals the batch shell only)")
        ids = [str(int(j)) for j in job_ids]
        if not ids:
            return
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={signal}")
        if batch_only:
            argv.append("--batch")
        argv += ids
        res = self._run(argv, check=False)
        if res.returncode == 0:
            return
        complaints = [line for line in (res.stderr or "").splitlines() if line.strip()]
        if complaints and all(_GONE.search(line) for line in complaints):
            log.debug("scancel: jobs already gone: %s", complaints)
            return
        raise SlurmError.failed("scancel failed", argv, res)

    def accounting(self, since: float, until: float) -> list[AccountedJob]:
        """Every job allocation (all users) that ran between `since` and `until` (Unix
        times), from Slurm's accounting database, in ONE sacct call. Raises SlurmError
        quoting sacct when the cluster keeps no accounting (no slurmdbd)."""
        argv = [
            "sacct",
            "--allusers",
            "--allocations",
            "--parsable2",
            "--noheader",
            f"--starttime={_sacct_time(since)}",
            f"--endtime={_sacct_time(until)}",
            f"--format={','.join(SACCT_FIELDS)}",
        ]
        return _parsed(argv, self._run(argv), parse_sacct, "sacct's output")

    # -- nodes
    def nodes(self) -> list[SlurmNode]:
        """Every node with its state list, reason and GRES.

        `scontrol show node --json` (23.02+); 22.05's scontrol has no --json, so there the
        client falls back to `sinfo --json` once and remembers that.
        """
        argv = self._nodes_argv or ["scontrol", "show", "node", "--json"]
        res = self._run(argv, check=False)
        if res.returncode != 0 and self._nodes_argv is None and "--json" in (res.stderr or ""):
            self._nodes_argv = argv = ["sinfo", "--json"]
            res = self._run(argv, check=False)
        if res.returncode != 0:
            raise SlurmError.failed(f"{argv[0]} failed", argv, res)
        self._nodes_argv = argv
        return _parsed(argv, res, parse_scontrol_show_node_json, "the node list")

    def topology(self) -> dict[str, str]:
        """Node -> its leaf switch (`scontrol show topology`, topology/tree); {} where the
        site has no switch topology (Slurm then says so on stderr and exits 0)."""
        argv = ["scontrol", "show", "topology"]
        return _parsed(argv, self._run(argv), parse_scontrol_show_topology, "the switch topology")

    def drain_node(self, node: str, reason: str) -> None:
        if not reason.strip():
            raise ValueError("Slurm needs a reason to drain a node")
        self._run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"])

    def resume_node(self, node: str) -> None:
        self._run(["scontrol", "update", f"nodename={node}", "state=resume"])

    def release(self) -> str:
        """Slurm's release, e.g. "22.05.8" (from `sbatch --version`, asked once)."""
        if self._release is None:
            argv = ["sbatch", "--version"]
            res = self._run(argv)
            match = re.search(r"\b(\d+\.\d+(?:\.\d+)?)", res.stdout)
            if match is None:
                raise SlurmError("cannot read the Slurm release", argv=argv, stdout=res.stdout)
            self._release = match.group(1)
        return self._release


def _parsed(
    argv: list[str],
    res: subprocess.CompletedProcess[str],
    parse: Callable[[str], T],
    what: str,
) -> T:
    """`parse` of what `argv` printed; where it cannot, a SlurmError naming `what`, with the
    parser's complaint (which quotes the output), the command and its stderr."""
    try:
        return parse(res.stdout)
    except SlurmParseError as exc:
        raise SlurmError(f"cannot read {what}: {exc}", argv=argv, stderr=res.stderr) from exc


def _sacct_time(epoch: float) -> str:
    """sacct's --starttime/--endtime: local time, to the second, as sacct reads it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch))


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else ""


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def make_slurm_client(
    env: Mapping[str, str] | None = None, prefer_pyslurm: bool = False
) -> SlurmClient:
    """The Slurm client for this process: the CLI (the only backend so far).

    With prefer_pyslurm, pyslurm is looked at and one warning line says why the CLI is used
    anyway: pyslurm absent, built for another Slurm release than the one running, or (when
    they match) no pyslurm backend implemented yet.
    """
    cli = SlurmCLI(env)
    if not prefer_pyslurm:
        return cli
    try:
        import pyslurm  # type: ignore[import-not-found,unused-ignore]
    except Exception as exc:  # ImportError, or a pyslurm whose libslurm does not load
        log.warning("pyslurm requested but not importable (%s); using the Slurm CLI", exc)
        return cli
    py_version = str(getattr(pyslurm, "__version__", ""))
    try:
        release = cli.release()
    except SlurmError as exc:
        log.warning("pyslurm requested but the Slurm release is unknown (%s); using the CLI", exc)
        return cli
    if _major_minor(py_version) != _major_minor(release) or _major_minor(release) is None:
        log.warning(
            "pyslurm %s does not match Slurm %s (major.minor must be equal); using the Slurm CLI",
            py_version or "(unknown version)",
            release,
        )
        return cli
    log.warning(
        "pyslurm %s matches Slurm %s, but no pyslurm backend exists yet; using the Slurm CLI",
        py_version,
        release,
    )
    return cli


__all__ = ["SlurmCLI", "SlurmClient", "SlurmError", "make_slurm_client"]
