"""A second, unprivileged Unix user for the security tests: what another cluster user can do.

The suite runs as root (it starts Slurm and the stack as the service account, root here).
`probe_user()` creates `hpcserve-probe` (a system user: no home, no login shell, no
password) when it is absent; `run_as()` runs an argv as that user with a clean, minimal
environment (nothing of the suite's leaks into it) and returns the finished process;
`run_python_as()` runs a snippet as that user with the system's Python 3 and this venv's
packages (pyzmq, httpx, hpcserve; the venv's own interpreter may sit under a home the
user cannot enter). Tests assert on what it can and cannot read or reach.
"""

from __future__ import annotations

import os
import pwd
import shutil
import site
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

PROBE_USER = "hpcserve-probe"
# What the probe's processes get, nothing more (PATH for ps, scontrol, cat, curl).
PROBE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/nonexistent",
    "PYTHONDONTWRITEBYTECODE": "1",
}


@dataclass(frozen=True)
class ProbeUser:
    name: str
    uid: int
    gid: int


def probe_user() -> ProbeUser:
    """The unprivileged user, created if absent (needs root: the suite runs as root)."""
    if os.geteuid() != 0:
        # A skip would let the security tests pass unseen on a run that is not root.
        pytest.fail("creating a second Unix user needs root (the suite runs as root)")
    try:
        entry = pwd.getpwnam(PROBE_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd", "--system", "--user-group", "--no-create-home",
                "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", PROBE_USER,
            ],
            check=True,
            capture_output=True,
            text=True,
        )  # fmt: skip
        entry = pwd.getpwnam(PROBE_USER)
    assert entry.pw_uid != 0 and entry.pw_gid != 0, f"{PROBE_USER} must not be root"
    return ProbeUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def run_as(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    input: str | None = None,
    cwd: str = "/",
) -> subprocess.CompletedProcess[str]:
    """argv as the probe user (runuser), its output captured; never raises on exit codes.
    `env` adds variables to the minimal PROBE_ENV (e.g. SLURM_CONF)."""
    user = probe_user()
    return subprocess.run(
        ["runuser", "-u", user.name, "--", *argv],
        env={**PROBE_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        cwd=cwd,
        check=False,
    )


def probe_python() -> str:
    """A Python of the venv's minor version that the probe user may run."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}", shutil.which(version)):
        if candidate and run_as([candidate, "-c", "pass"]).returncode == 0:
            return candidate
    raise AssertionError(f"no {version} that {PROBE_USER} may run (install Debian's python3)")


def run_python_as(
    code: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """`python -c code args...` as the probe user, with the venv's packages importable."""
    packages = [p for p in site.getsitepackages() if p.startswith(sys.prefix)]
    prelude = f"import site\nfor p in {packages!r}:\n    site.addsitedir(p)\n"
    return run_as([probe_python(), "-c", prelude + code, *args], env=env, timeout=timeout)


def readable_by_probe(path: str | os.PathLike[str]) -> bool:
    """Whether the probe user can open `path` for reading (the kernel's own answer)."""
    return run_as(["cat", os.fspath(path)]).returncode == 0


def listable_by_probe(path: str | os.PathLike[str]) -> bool:
    return run_as(["ls", os.fspath(path)]).returncode == 0
