"""deploy/systemd/: the units as shipped and as `hpcserve install-units` writes them pass
`systemd-analyze verify` without a warning, run as an unprivileged account in a sandbox
that may write only the config's own paths, and restart as each service needs. (Running
their command lines against Slurm: tests/integration/test_systemd_services.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcserve.config import parse_config
from hpcserve.units import (
    DEFAULT_CONFIG,
    DEFAULT_PREFIX,
    UNIT_FILES,
    UnitError,
    UnitSettings,
    render_unit,
    units_dir,
    writable_paths,
)
from tests.systemd_units import parse_unit, service_command

SERVICES = [name for name in UNIT_FILES if name.endswith(".service")]

# unit -> (Restart=, RestartSec=, what else restarting needs)
RESTART = {
    "hpcserve-router.service": ("always", "1", {}),
    "hpcserve-gateway@.service": ("always", "2", {}),
    # Never twice: exit 3 (another holds the lock) is not restarted; children go with it.
    "hpcserve-poolmgr.service": (
        "on-failure",
        "10",
        {"RestartPreventExitStatus": ["3"], "KillMode": ["mixed"]},
    ),
    "hpcserve-batch-runner.service": ("always", "5", {}),
}

HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "read-only",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "RestrictSUIDSGID": "yes",
    "CapabilityBoundingSet": "",
    "UMask": "0077",
}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def rendered(tmp_path: Path) -> Path:
    """install-units for a config whose batch dir lies outside its state dir."""
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "hpcserve").write_text("#!/bin/sh\n")
    (prefix / "bin" / "hpcserve").chmod(0o755)
    config = tmp_path / "hpcserve.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[batch]\ndir = "{tmp_path / "batch"}"\n'
        "[gateway]\nport = 8100\n"
    )
    out = _cli(
        "install-units", "--config", str(config), "--prefix", str(prefix),
        "--dest", str(tmp_path / "units"), "--user", "hpcserve-svc",
        "--gateway-port", "8101", "--gateway-port", "8102",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("wrote ") == len(UNIT_FILES)
    return tmp_path


def _verify(unit: Path) -> str:
    """systemd-analyze verify's whole output: errors and warnings (its exit status is 0 for
    a warning, such as an unknown key, so the output is what tells)."""
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing (Debian: systemd)"
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return (out.stdout + out.stderr).strip() + (
        "" if out.returncode == 0 else f" rc={out.returncode}"
    )


def test_systemd_analyze_verify_is_strict_here(tmp_path: Path) -> None:
    """The control: a bad value and an unknown key are reported (so silence means clean)."""
    text = (units_dir() / "hpcserve-router.service").read_text()
    bad = tmp_path / "bad.service"
    bad.write_text(
        text.replace("ProtectSystem=strict", "ProtectSystem=bogus\nRestartz=always").replace(
            DEFAULT_PREFIX + "/bin/hpcserve", "/bin/true"
        )
    )
    said = _verify(bad)
    assert "Failed to parse protect system value" in said and "Unknown key 'Restartz'" in said


@pytest.mark.parametrize(
    "unit",
    [
        "hpcserve-router.service",
        "hpcserve-gateway@8101.service",
        "hpcserve-poolmgr.service",
        "hpcserve-batch-runner.service",
        "hpcserve.target",
    ],
)
def test_installed_units_verify_clean(rendered: Path, unit: str) -> None:
    assert _verify(rendered / "units" / unit) == ""


@pytest.mark.parametrize("name", SERVICES)
def test_each_service_runs_unprivileged_in_a_sandbox_with_its_restart_policy(
    rendered: Path, name: str
) -> None:
    instance = "8101" if "@" in name else ""
    command = service_command(rendered / "units" / name, instance)
    assert command.user == "hpcserve-svc" and command.one("Group") == "hpcserve-svc"
    assert command.argv[0] == str(rendered / "venv" / "bin" / "hpcserve")
    assert command.argv[1:4] == [
        name.removeprefix("hpcserve-").split("@")[0].removesuffix(".service"),
        "--config",
        str(rendered / "hpcserve.toml"),
    ]
    assert command.env["HPCSERVE_CONFIG"] == str(rendered / "hpcserve.toml")
    for key, value in HARDENING.items():
        assert command.one(key) == value, key
    # The state dir and the batch dir the config puts outside it: nothing else.
    assert command.one("ReadWritePaths").split() == [
        str(rendered / "state"),
        str(rendered / "batch"),
    ]
    restart, delay, more = RESTART[name]
    assert (command.one("Restart"), command.one("RestartSec")) == (restart, delay)
    for key, values in more.items():
        assert command.unit["Service"][key] == values
    assert command.one("Type") == "exec"
    assert "StandardOutput" not in command.unit["Service"]  # the journal, systemd's default


def test_the_gateway_instance_is_its_port_and_the_target_starts_each(rendered: Path) -> None:
    command = service_command(rendered / "units" / "hpcserve-gateway@.service", "8102")
    assert command.argv[-2:] == ["--port", "8102"]
    assert command.one("SyslogIdentifier") == "hpcserve-gateway@8102"
    target = parse_unit((rendered / "units" / "hpcserve.target").read_text())
    wants = target["Unit"]["Wants"][0].split()
    assert [w for w in wants if "gateway" in w] == [
        "hpcserve-gateway@8101.service",
        "hpcserve-gateway@8102.service",
    ]


def test_shipped_units_carry_the_default_layout() -> None:
    for name in SERVICES:
        command = service_command(units_dir() / name, "8000")
        assert command.argv[0] == f"{DEFAULT_PREFIX}/bin/hpcserve"
        assert DEFAULT_CONFIG in command.argv and command.user == "hpcserve"
        assert render_unit(name, (units_dir() / name).read_text(), UnitSettings()) == (
            (units_dir() / name).read_text()
        )
    limits = parse_unit((units_dir() / "examples" / "limits.conf").read_text())
    assert {"MemoryMax", "CPUQuota", "TasksMax", "LimitNOFILE"} <= set(limits["Service"])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (UnitSettings(user="root"), "--user: root"),
        (UnitSettings(user="Bad User"), "not a Unix account name"),
        (UnitSettings(prefix="venv"), "--prefix: 'venv': expected an absolute path"),
        (UnitSettings(writable=("/srv/my state",)), "writable path '/srv/my state'"),
    ],
)
def test_unsafe_settings_are_refused(settings: UnitSettings, message: str) -> None:
    with pytest.raises(UnitError, match=message):
        render_unit("hpcserve-router.service", "[Service]\n", settings)


def test_writable_paths_are_the_state_dir_and_what_lies_outside_it(tmp_path: Path) -> None:
    config = parse_config(
        {
            "state_dir": str(tmp_path / "s"),
            "batch": {"dir": str(tmp_path / "s" / "batch")},  # inside: covered
            "slurm": {"log_dir": str(tmp_path / "joblogs")},
            "gateway": {"audit_log": str(tmp_path / "log" / "audit.log")},
        }
    )
    assert writable_paths(config) == (
        str(tmp_path / "s"),
        str(tmp_path / "joblogs"),
        str(tmp_path / "log"),
    )


def test_install_units_as_root_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "hpcserve.toml"
    config.write_text(f'state_dir = "{tmp_path}"\n')
    out = _cli("install-units", "--config", str(config), "--user", "root", "--dest", str(tmp_path))
    assert out.returncode == 2
    assert "unprivileged service account" in out.stderr
