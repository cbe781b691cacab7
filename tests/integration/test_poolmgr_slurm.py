"""The pool manager's control loop against a real Slurm cluster.

The jobs are the real rendered template running the real `hpcserve engine`; vLLM is not
the point here, so the pool's model path does not exist and each engine fails at once,
which is exactly the failure the pool manager must replace.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from hpcserve.config import PlatformConfig, parse_config
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.poolmgr.launchers import LocalLauncher
from hpcserve.poolmgr.manager import PoolManager
from hpcserve.poolmgr.slurm import SlurmCLI
from hpcserve.poolmgr.slurm_parse import JobState
from tests.integration.slurm_helpers import wait_for

pytestmark = pytest.mark.slurm


def make_config(cluster: LocalSlurm, tmp_path: Path, prefix: str) -> PlatformConfig:
    return parse_config(
        {
            "state_dir": str(tmp_path),
            "slurm": {
                "conf": str(cluster.conf_path),
                "log_dir": str(tmp_path / "jobs"),
                "partition": "gpu",
                "time_limit_min": 10,
                "drain_s": 10,
            },
            "poolmgr": {"poll_s": 0.5, "min_submit_interval_s": 0.5, "job_name_prefix": prefix},
            "pools": [
                {"name": "broken", "model_path": str(tmp_path / "no-such-model"), "replicas": 2}
            ],
        }
    )


def ours(slurm: SlurmCLI, prefix: str) -> list:
    return [j for j in slurm.jobs(name_prefix=prefix + "-").jobs if parse_comment(j.comment)]


def test_submits_to_size_replaces_failed_jobs_and_polls_once(
    cluster: LocalSlurm, slurm: SlurmCLI, tmp_path: Path
) -> None:
    manager = PoolManager(make_config(cluster, tmp_path, "pm1"), slurm)
    manager.poll_once()
    assert slurm.calls["squeue"] == 1 and slurm.calls["sbatch"] == 2
    first = ours(slurm, "pm1")
    assert len(first) == 2
    assert {parse_comment(j.comment).pool for j in first} == {"broken"}
    assert len({j.comment for j in first}) == 2, "each job carries its own nonce"
    assert {j.name for j in first} == {"pm1-broken"}

    # The engines fail at once (no model); the next polls replace them.
    first_ids = {j.job_id for j in first}
    wait_for(
        "the first jobs to fail",
        lambda: all(
            j.state is JobState.FAILED for j in ours(slurm, "pm1") if j.job_id in first_ids
        ),
        timeout=20,
    )
    log = next((tmp_path / "jobs").glob(f"pm1-broken-{min(first_ids)}.out")).read_text()
    assert "is not a directory on node" in log and "no-such-model" in log

    polls = slurm.calls["squeue"]
    wait_for(
        "replacements",
        lambda: (
            (manager.poll_once() or True)
            and len([j for j in ours(slurm, "pm1") if j.job_id not in first_ids]) >= 2
        ),
        timeout=20,
    )
    # One squeue per poll (plus this test's own reads via ours()), never one per job.
    assert manager.metrics.actions.labels("submit", "broken")._value.get() >= 2
    assert slurm.calls["sbatch"] >= 4
    assert slurm.calls["squeue"] - polls >= 1


def test_restart_rebuilds_from_slurm_and_scale_down_cancels_pending(
    cluster: LocalSlurm, slurm: SlurmCLI, tmp_path: Path
) -> None:
    # Fill both nodes with an admin's own jobs so ours stay PENDING.
    blocker = "#!/bin/bash\n#SBATCH --gres=gpu:4\n#SBATCH -J admin-block\nsleep 60\n"
    blockers = [slurm.submit(blocker) for _ in range(2)]
    wait_for(
        "the nodes to be busy",
        lambda: all(j.state is JobState.RUNNING for j in slurm.jobs().jobs if j.job_id in blockers),
    )

    config = make_config(cluster, tmp_path, "pm2")
    PoolManager(config, slurm).poll_once()
    # Slurm says why they wait once the scheduler has looked at them (within ~1 s here).
    wait_for(
        "two jobs pending on Resources or Priority",
        lambda: (
            (js := ours(slurm, "pm2"))
            and len(js) == 2
            and all(j.state is JobState.PENDING for j in js)
            and {j.state_reason for j in js} <= {"Resources", "Priority"}
        ),
    )

    # A new pool manager (a restart) sees the pool at size and submits nothing.
    restarted = PoolManager(config, slurm)
    before = slurm.calls["sbatch"]
    restarted.poll_once()
    assert slurm.calls["sbatch"] == before

    # Scale to zero: pending jobs are cancelled outright; the admin's jobs are untouched.
    scaled = msgspec.structs.replace(
        config, pools=[msgspec.structs.replace(config.pools[0], replicas=0)]
    )
    PoolManager(scaled, slurm).poll_once()
    wait_for(
        "our jobs cancelled",
        lambda: all(j.state is JobState.CANCELLED for j in ours(slurm, "pm2")),
        timeout=10,
    )
    assert all(j.state is JobState.RUNNING for j in slurm.jobs().jobs if j.job_id in blockers)


def test_local_launcher_runs_the_same_script_without_slurm(tmp_path: Path) -> None:
    config = parse_config(
        {
            "state_dir": str(tmp_path),
            "poolmgr": {"launcher": "local", "min_submit_interval_s": 0.5},
            "pools": [{"name": "broken", "model_path": str(tmp_path / "nothing"), "replicas": 1}],
        }
    )
    launcher = LocalLauncher(tmp_path / "jobs")
    manager = PoolManager(config, launcher)
    manager.poll_once()
    (job,) = launcher.jobs().jobs
    assert job.state is JobState.RUNNING and parse_comment(job.comment).pool == "broken"
    wait_for(
        "the local job to fail",
        lambda: launcher._jobs[job.job_id].proc.poll() is not None,
        timeout=20,
    )
    assert launcher.jobs().jobs[0].state is JobState.FAILED
    out = (tmp_path / "jobs" / f"hpcserve-broken-local{job.job_id}.out").read_text()
    assert "is not a directory on node" in out
    # The failed job is forgotten and replaced on the next poll.
    manager.poll_once()
    assert [j.job_id for j in launcher.jobs().jobs] == [job.job_id + 1]
    launcher.shutdown(timeout_s=10)
    assert all(j.state is not JobState.RUNNING for j in launcher.jobs().jobs)
