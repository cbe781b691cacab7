"""`hpcserve install-units`: deploy/systemd/'s unit files written with a site's values.

The files under deploy/systemd/ are complete units for the default layout (a venv in
/opt/hpcserve/venv, the config in /etc/hpcserve/hpcserve.toml, the state in /srv/hpcserve,
the service account `hpcserve`); a site may copy them and edit those values. `render_unit`
does that edit: it swaps the defaults for the given venv, config, user and group, and writes
ReadWritePaths from the config's own writable paths (its state dir, and any directory it
sets outside it: batch, responses, usage, job logs, scrape targets), so the sandbox and the
config cannot disagree.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from hpcserve.config import PlatformConfig

DEFAULT_PREFIX = "/opt/hpcserve/venv"
DEFAULT_CONFIG = "/etc/hpcserve/hpcserve.toml"
DEFAULT_USER = "hpcserve"
DEFAULT_WRITABLE = "/srv/hpcserve"
UNIT_FILES = (
    "hpcserve-router.service",
    "hpcserve-gateway@.service",
    "hpcserve-poolmgr.service",
    "hpcserve-batch-runner.service",
    "hpcserve.target",
)
_UNSAFE = re.compile(r"[\s\"'\\%$]")


class UnitError(ValueError):
    pass


def units_dir() -> Path:
    """deploy/systemd/ of this source tree (the units are not part of the wheel)."""
    return Path(__file__).resolve().parents[1] / "deploy" / "systemd"


@dataclass(frozen=True)
class UnitSettings:
    prefix: str = DEFAULT_PREFIX  # the venv whose bin/hpcserve the units run
    config: str = DEFAULT_CONFIG
    user: str = DEFAULT_USER
    group: str = ""  # default: the user's name
    writable: tuple[str, ...] = (DEFAULT_WRITABLE,)
    gateway_ports: tuple[int, ...] = (8000,)

    def check(self) -> None:
        for key, value in (("prefix", self.prefix), ("config", self.config)):
            if not value.startswith("/") or _UNSAFE.search(value):
                raise UnitError(f"--{key}: {value!r}: expected an absolute path, no spaces")
        for path in self.writable:
            if not path.startswith("/") or _UNSAFE.search(path):
                raise UnitError(f"writable path {path!r}: expected absolute, no spaces")
        for key, value in (("user", self.user), ("group", self.group or self.user)):
            if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", value):
                raise UnitError(f"--{key}: {value!r} is not a Unix account name")
        if self.user == "root":
            raise UnitError("--user: root; hpcserve runs as an unprivileged service account")


def writable_paths(config: PlatformConfig) -> tuple[str, ...]:
    """Where the services write: the state dir, and each configured directory outside it."""
    state = Path(config.state_dir).resolve()
    candidates = [
        Path(config.batch_dir()),
        Path(config.responses_dir()),
        Path(config.usage_dir()),
        Path(config.registry_path()).parent,
    ]
    if config.slurm.log_dir:
        candidates.append(Path(config.slurm.log_dir))
    if config.poolmgr.scrape_targets_file:
        candidates.append(Path(config.poolmgr.scrape_targets_file).parent)
    if config.gateway.audit_log not in ("", "-"):
        candidates.append(Path(config.gateway.audit_log).parent)
    out = [str(state)]
    for path in (p.resolve() for p in candidates):
        if path != state and state not in path.parents and str(path) not in out:
            out.append(str(path))
    return tuple(out)


def render_unit(name: str, text: str, settings: UnitSettings) -> str:
    settings.check()
    group = settings.group or settings.user
    out = []
    for line in text.splitlines():
        if line.startswith(("ExecStart=", "ExecReload=")):
            line = line.replace(DEFAULT_PREFIX, settings.prefix)
            line = line.replace(DEFAULT_CONFIG, settings.config)
        elif line.startswith("Environment=HPCSERVE_CONFIG="):
            line = f"Environment=HPCSERVE_CONFIG={settings.config}"
        elif line.startswith("User="):
            line = f"User={settings.user}"
        elif line.startswith("Group="):
            line = f"Group={group}"
        elif line.startswith("ReadWritePaths="):
            line = "ReadWritePaths=" + " ".join(settings.writable)
        elif line.startswith("Wants=") and name == "hpcserve.target":
            words = [w for w in line[len("Wants=") :].split() if "gateway@" not in w]
            words += [f"hpcserve-gateway@{port}.service" for port in settings.gateway_ports]
            line = "Wants=" + " ".join(words)
        out.append(line)
    return "\n".join(out) + "\n"


def install_units(dest: Path, settings: UnitSettings, source: Path | None = None) -> list[Path]:
    """Write every unit of deploy/systemd/ into `dest`; the paths written."""
    source = source or units_dir()
    if not (source / UNIT_FILES[0]).exists():
        raise UnitError(
            f"no unit files in {source}: install-units renders deploy/systemd/ of a source "
            "checkout (pip install -e); copy them from the release's source instead"
        )
    settings.check()
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in UNIT_FILES:
        path = dest / name
        path.write_text(render_unit(name, (source / name).read_text(), settings))
        path.chmod(0o644)
        written.append(path)
    return written


def default_prefix() -> str:
    """The venv running this command."""
    return sys.prefix
