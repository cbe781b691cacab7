"""Fixtures for tests against a real two-node Slurm cluster (one per test module)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcserve.contracts.router_client import list_models
from hpcserve.localslurm import LocalSlurm
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from tests.integration.pool_rig import PoolRig
from tests.integration.slurm_helpers import running_cluster, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    yield from running_cluster(tmp_path_factory.mktemp("localslurm"))


@pytest.fixture
def slurm(cluster: LocalSlurm) -> Iterator[SlurmCLI]:
    client = SlurmCLI(cluster.env(), timeout_s=10)
    yield client
    # leave no active job to the next test
    active = [j.job_id for j in client.jobs().jobs if j.state.is_active]
    client.cancel(active)
    wait_for("all jobs to end", lambda: not any(j.state.is_active for j in client.jobs().jobs))


@pytest.fixture
def rig(
    cluster: LocalSlurm,
    slurm: SlurmCLI,
    router: RouterServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> PoolRig:
    """A pool-manager test's setup on the cluster (tests/integration/pool_rig.py)."""
    return PoolRig(cluster, slurm, router, tmp_path, caplog)


@pytest.fixture
def engine(router: RouterServer) -> Iterator[subprocess.Popen[str]]:
    """`hpcserve engine --engine sim` registered with the test router (10 ms per token)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpcserve.cli",
            "engine",
            "--engine",
            "sim",
            "--model-path",
            "/nonexistent",
            "--served-model-name",
            "sim",
            "--pool",
            "simpool",
            "--router",
            router.config.registry_bind,
            "--bind-host",
            "127.0.0.1",
            "--advertise-host",
            "127.0.0.1",
            "--heartbeat-s",
            "0.25",
            "--drain-s",
            "10",
            "--",
            "--decode-ms-per-token",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for("the engine to register", lambda: list_models(router.config.routing_bind))
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()  # the simulated engine gets SIGTERM through PR_SET_PDEATHSIG
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture
def short_state_dir() -> Iterator[Path]:
    """A state dir near /: slurmd's socket paths under it must stay within 107 bytes, which
    pytest's tmp_path (.../pytest-of-root/pytest-NNN/<test name>/) can exceed."""
    where = Path(tempfile.mkdtemp(prefix="hpt-"))
    yield where / "state"
    shutil.rmtree(where, ignore_errors=True)
