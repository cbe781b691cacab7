"""Fixtures for tests against a real two-node Slurm cluster (one per test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hpcserve.localslurm import LocalSlurm, LocalSlurmSpec, preflight
from hpcserve.poolmgr.slurm import SlurmCLI
from tests.integration.slurm_helpers import conf_processes, free_port_block, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    assert preflight() == [], preflight()
    spec = LocalSlurmSpec(
        state_dir=tmp_path_factory.mktemp("localslurm"), ctld_port=free_port_block()
    )
    assert spec.ctld_port != 16817
    local = LocalSlurm(spec)
    local.start()
    try:
        yield local
    finally:
        local.stop()
    assert conf_processes(local.conf_path) == []


@pytest.fixture
def slurm(cluster: LocalSlurm) -> Iterator[SlurmCLI]:
    client = SlurmCLI(cluster.env(), timeout_s=10)
    yield client
    # leave no active job to the next test
    active = [j.job_id for j in client.jobs().jobs if j.state.is_active]
    client.cancel(active)
    wait_for(
        "all jobs to end",
        lambda: not any(j.state.is_active for j in client.jobs().jobs),
        timeout=15,
    )
