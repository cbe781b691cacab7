"""Engines on compute nodes, in a real Slurm job: the pool's launch prefix (a wrapper that
records what it was asked to run, then runs it, as `apptainer exec` or Pyxis's srun would)
and its `module load` line reach the job as rendered; the engine under the wrapper
registers, serves and drains on Slurm's USR1 through its drain file; no secret is in the
script, the argv or `scontrol show job`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from hpcserve.contracts.engine_token import auth_headers, ensure_token, read_token
from hpcserve.contracts.router_client import list_replicas
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.render import render
from hpcserve.poolmgr.spec import build_job_spec, job_log_dir, resolve_model
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from tests.integration.slurm_helpers import cluster_config, wait_for

pytestmark = pytest.mark.slurm

WRAPPER = """#!/bin/bash
# A launch prefix: records its argv (one word a line) and the environment it was given,
# then runs the command, as `apptainer exec IMAGE CMD...` would.
[ "$1" = --record ] || { echo "usage: $0 --record FILE CMD..." >&2; exit 2; }
record="$2"
shift 2
printf '%s\\n' "$@" > "$record.argv"
env > "$record.env"
exec "$@"
"""

MODULE = """#!/bin/bash
# Stands in for Lmod's `module`: records what it was asked to load.
echo "$*" >> "$MODULE_RECORD"
"""


def test_a_wrapped_engine_with_modules_serves_and_drains_in_a_slurm_job(
    cluster: LocalSlurm, router: RouterServer, slurm: SlurmCLI, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("launch-wrapper", WRAPPER), ("module", MODULE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "launched"
    modules_record = tmp_path / "modules"
    config = cluster_config(
        cluster,
        router,
        tmp_path,
        "hs-launch",
        {
            "model_path": "/nonexistent",
            "engine": "sim",
            "engine_args": ["--decode-ms-per-token", "5"],
            # The job's PATH finds the stand-in `module` (a site's comes from Lmod's init).
            "env": {
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "MODULE_RECORD": str(modules_record),
            },
        },
        engine={
            "bind_host": "127.0.0.1",
            "advertise_host": "127.0.0.1",
            "launch_prefix": [str(bin_dir / "launch-wrapper"), "--record", str(record)],
            "modules": ["cuda/12.4", "hpcserve/0.1"],
        },
    )
    token = ensure_token(config.engine_token_path())
    pool = config.pools[0]
    script = render(build_job_spec(config, pool, resolve_model(config, pool)))
    job_log_dir(config).mkdir()  # the pool manager makes it; this test submits by itself
    job_id = slurm.submit(script)

    replica = wait_for("the wrapped engine to register", lambda: list_replicas(
        router.config.routing_bind
    ))[0]  # fmt: skip
    assert replica.slurm_job_id == job_id
    assert modules_record.read_text() == "load cuda/12.4 hpcserve/0.1\n"
    argv = (tmp_path / "launched.argv").read_text().splitlines()
    assert argv[:2] == [build_job_spec(config, pool).hpcserve_bin, "engine"]
    assert argv[argv.index("--engine") + 1] == "sim"
    drain_file = argv[argv.index("--drain-file") + 1]
    assert argv[argv.index("--") + 1 :][:2] == ["--decode-ms-per-token", "5"]
    # The engine under the wrapper serves (with the engine token, from its file).
    reply = httpx.post(
        f"{replica.url}/v1/completions",
        json={"model": replica.model, "prompt": "a b", "max_tokens": 2},
        headers=auth_headers(token),
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == " tok0 tok1"

    # No secret in the script, the argv, the environment Slurm shows, or the job record.
    shown = subprocess.run(
        ["scontrol", "show", "job", "-dd", str(job_id)],
        env=cluster.env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert read_token(config.engine_token_path()) == token
    for where, text in (
        ("script", script),
        ("argv", "\n".join(argv)),
        ("scontrol show job", shown),
    ):
        assert token not in text, where
    assert f"HPCSERVE_ENGINE_TOKEN_FILE={config.engine_token_path()}" in script

    # Slurm's drain signal (what --signal=B:USR1@drain_s sends) becomes the drain file: the
    # engine leaves routing and the job ends by itself.
    slurm.cancel([job_id], signal="USR1", batch_only=True)
    wait_for("the replica to leave", lambda: not list_replicas(router.config.routing_bind))
    wait_for(
        "the job to end by itself",
        lambda: not any(j.job_id == job_id and j.state.is_active for j in slurm.jobs().jobs),
    )
    output = next((tmp_path / "jobs").glob(f"*-{job_id}.out")).read_text()
    assert f"drain requested ({drain_file})" in output
    assert not Path(drain_file).parent.exists(), "the job's run dir is removed"
