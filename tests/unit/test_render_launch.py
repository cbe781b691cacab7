"""Engines on compute nodes: a launch prefix (a container) and `module load` in the job
script (engine.launch_prefix, engine.modules, a pool's own; poolmgr/render.py).

The rendered scripts run here in bash, outside Slurm, with a recording `module` command and
a recording launcher standing in for apptainer or srun: what they were asked to run is
checked word for word. The same through a real Slurm job: tests/integration/
test_engine_launch_prefix.py."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hpcserve.config import ConfigError, parse_config
from hpcserve.contracts.engine_token import ensure_token, read_token
from hpcserve.poolmgr.render import JobSpec, render
from hpcserve.poolmgr.spec import build_job_spec
from tests.integration.slurm_helpers import wait_for

SPEC = JobSpec(
    job_name="hpcserve-chat",
    comment="hpcserve:pool=chat;model=m;nonce=00000000",
    gpus=1,
    time_limit_min=60,
    drain_s=30,
    hpcserve_bin="/opt/hpcserve/venv/bin/hpcserve",
    model_path="/models/m",
    model="m",
    router="tcp://ctl:5560",
    pool="chat",
    engine="vllm",
)

RECORDER = """#!/bin/bash
# Records its argv, one word a line, then a line "--"; runs nothing.
for word in "$@"; do printf '%s\\n' "$word"; done >> "$RECORD"
echo -- >> "$RECORD"
"""


def _run(
    tmp_path: Path, script: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    """Run a rendered script in bash with recording `module` and launcher commands on PATH;
    what each was called with, in order."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("module", "apptainer", "srun", "hpcserve"):
        tool = bin_dir / name
        tool.write_text(RECORDER)
        tool.chmod(0o755)
    record = tmp_path / "record"
    record.write_text("")
    path = tmp_path / "job.sh"
    path.write_text(script)
    out = subprocess.run(
        ["bash", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "RECORD": str(record),
            "TMPDIR": str(tmp_path),
            **env,
        },
    )
    calls: list[list[str]] = [[]]
    for line in record.read_text().splitlines():
        if line == "--":
            calls.append([])
        else:
            calls[-1].append(line)
    return out, [c for c in calls if c]


def _engine_words(bin_path: str) -> list[str]:
    return [bin_path, "engine", "--model-path", "/models/m", "--served-model-name", "m"]


@pytest.mark.parametrize(
    ("change", "module_calls", "launch"),
    [
        # Nothing set: the engine runs as it is, no module command is called.
        ({}, [], []),
        # Apptainer: the prefix words, verbatim (a space in the image's path survives).
        (
            {"launch_prefix": ("apptainer", "exec", "--nv", "--bind", "/srv/hs", "/img/a b.sif")},
            [],
            ["exec", "--nv", "--bind", "/srv/hs", "/img/a b.sif"],
        ),
        # Pyxis: srun with its container options.
        (
            {
                "launch_prefix": (
                    "srun",
                    "--container-image=/img/hs.sqsh",
                    "--container-mounts=/srv",
                )
            },
            [],
            ["--container-image=/img/hs.sqsh", "--container-mounts=/srv"],
        ),
        # Modules: one `module load` with all of them, before the engine starts.
        ({"modules": ("cuda/12.4", "python/3.11")}, [["load", "cuda/12.4", "python/3.11"]], []),
        (
            {"modules": ("cuda/12.4",), "launch_prefix": ("apptainer", "exec", "/img/hs.sif")},
            [["load", "cuda/12.4"]],
            ["exec", "/img/hs.sif"],
        ),
    ],
)
def test_rendered_script_runs_the_engine_under_its_prefix_after_module_load(
    tmp_path: Path, change: dict[str, Any], module_calls: list[list[str]], launch: list[str]
) -> None:
    spec = JobSpec(**(SPEC.__dict__ | change | {"hpcserve_bin": "hpcserve"}))
    script = render(spec)
    for name, words in (("MODULES", spec.modules), ("LAUNCH_PREFIX", spec.launch_prefix)):
        line = f"HPCSERVE_{name}=(" + " ".join(shlex.quote(w) for w in words) + ")"
        assert (line in script.split("# @end settings")[0]) is bool(words)
    out, calls = _run(tmp_path, script)
    assert out.returncode == 0, out.stderr
    # The recorders do not start one another: a prefix's call records the prefix's own words
    # (and the engine command after them), the engine's own call only exists without one.
    assert calls[: len(module_calls)] == module_calls
    engine_call = calls[len(module_calls)]
    expected = [*launch, *_engine_words("hpcserve")] if launch else _engine_words("hpcserve")[1:]
    assert engine_call[: len(expected)] == expected
    assert "--drain-file" in engine_call
    assert len(calls) == len(module_calls) + 1
    assert not list(tmp_path.glob("hpcserve-job-*")), "the job's run dir is removed at the end"


def test_a_failed_module_load_stops_the_job_before_the_engine(tmp_path: Path) -> None:
    script = render(JobSpec(**(SPEC.__dict__ | {"modules": ("nosuch/1.0",)})))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "module").write_text('#!/bin/bash\necho "Lmod has detected: $*" >&2\nexit 1\n')
    (bin_dir / "module").chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    out = subprocess.run(
        ["bash", str(tmp_path / "job.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    assert out.returncode == 1
    assert "hpcserve: 'module load nosuch/1.0' failed" in out.stderr


FAKE_ENGINE = """#!/bin/bash
# Stands in for `hpcserve engine`: waits for its --drain-file, as the engine does.
while [ $# -gt 0 ]; do
  if [ "$1" = --drain-file ]; then drain="$2"; fi
  shift
done
echo started > "$RECORD"
while [ ! -e "$drain" ]; do sleep 0.05; done
echo drained > "$RECORD"
"""

LAUNCHER = """#!/bin/bash
# A launcher that, like srun, does not pass signals to its child's own handling here:
# it ignores USR1 and TERM itself, so only the drain file can end the engine gracefully.
trap '' USR1 TERM
"$@"
"""


def test_a_drain_request_reaches_an_engine_under_a_launcher_through_the_drain_file(
    tmp_path: Path,
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("engine", FAKE_ENGINE), ("launcher", LAUNCHER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "record"
    spec = JobSpec(
        **(
            SPEC.__dict__
            | {"hpcserve_bin": str(bin_dir / "engine"), "launch_prefix": ("launcher",)}
        )
    )
    (tmp_path / "job.sh").write_text(render(spec))
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "job.sh")],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "TMPDIR": str(tmp_path)},
    )
    try:
        wait_for(
            "the fake engine to start",
            lambda: record.exists() and record.read_text().strip() == "started",
        )
        proc.send_signal(signal.SIGUSR1)  # what Slurm's --signal=B:USR1 does
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert record.read_text().strip() == "drained"
    assert not list(tmp_path.glob("hpcserve-job-*"))


def _config(tmp_path: Path, engine: dict[str, Any], pool: dict[str, Any] | None = None) -> Any:
    return parse_config(
        {
            "state_dir": str(tmp_path),
            "engine": engine,
            "pools": [{"name": "p", "model_path": "/models/m", **(pool or {})}],
        }
    )


def test_the_pools_own_prefix_and_modules_win_and_the_token_stays_out(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        {
            "launch_prefix": ["apptainer", "exec", "--nv", "/img/site.sif"],
            "modules": ["cuda/12.4"],
            "hpcserve_bin": "hpcserve",
        },
        {"launch_prefix": ["apptainer", "exec", "--nv", "/img/other.sif"], "modules": []},
    )
    ensure_token(config.engine_token_path())
    spec = build_job_spec(config, config.pools[0])
    assert spec.launch_prefix == ("apptainer", "exec", "--nv", "/img/other.sif")
    assert spec.modules == ()
    assert spec.hpcserve_bin == "hpcserve"
    script = render(spec)
    assert "HPCSERVE_LAUNCH_PREFIX=(apptainer exec --nv /img/other.sif)" in script
    assert "\nHPCSERVE_MODULES=" not in script.split("# @end settings")[0]
    token = read_token(config.engine_token_path())
    assert token and token not in script  # the path is there, never the secret
    assert f"HPCSERVE_ENGINE_TOKEN_FILE={config.engine_token_path()}" in script
    site = _config(tmp_path, {"modules": ["cuda/12.4"]})
    assert build_job_spec(site, site.pools[0]).modules == ("cuda/12.4",)


@pytest.mark.parametrize(
    ("engine", "pool", "message"),
    [
        (
            {"launch_prefix": ["--nv", "apptainer"]},
            {},
            r"engine.launch_prefix\[0\]: '--nv' is an option",
        ),
        (
            {"launch_prefix": ["apptainer", "exec", "--env=HF_TOKEN=hf_abc", "/i.sif"]},
            {},
            r"engine.launch_prefix\[2\]: HF_TOKEN=... looks like a secret",
        ),
        (
            {},
            {"launch_prefix": ["env", "OVERFLOW_API_KEY=sk-1", "x"]},
            r"pools\[0\].launch_prefix\[1\]: OVERFLOW_API_KEY=... looks like a secret",
        ),
        (
            {"launch_prefix": ["srun", "--container-image=/i.sqsh"]},
            {"nodes_per_replica": 2, "gpus_per_replica": 1, "tensor_parallel": 2},
            "engine.launch_prefix: a prefix starting with srun cannot wrap a multi-node replica",
        ),
        ({"launch_prefix": ["apptainer", ""]}, {}, r"engine.launch_prefix\[1\]"),
        ({"modules": ["cuda 12"]}, {}, r"engine.modules\[0\]"),
        ({}, {"modules": ["$(reboot)"]}, r"pools\[0\].modules\[0\]"),
    ],
)
def test_bad_launch_settings_are_refused_naming_the_key(
    tmp_path: Path, engine: dict[str, Any], pool: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, engine, pool)


def test_a_bind_of_the_secrets_directory_is_no_secret(tmp_path: Path) -> None:
    config = _config(
        tmp_path, {"launch_prefix": ["apptainer", "exec", "--bind", "/srv/hs/secrets", "/i.sif"]}
    )
    assert config.engine.launch_prefix[3] == "/srv/hs/secrets"
    assert os.fspath(tmp_path) == config.state_dir
