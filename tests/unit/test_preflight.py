"""A machine without root or without Slurm gets a clear message, and `up` a local fallback."""

import pytest

from hpcserve import localslurm
from hpcserve.stack import Stack


@pytest.fixture
def laptop(monkeypatch):
    monkeypatch.setattr(localslurm.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(
        localslurm, "_which", lambda name: None if name.startswith("slurm") else f"/usr/bin/{name}"
    )


def test_preflight_names_every_problem_and_the_fix(laptop):
    problems = localslurm.preflight()
    assert len(problems) == 2
    assert problems[0].startswith("not running as root")
    assert "missing Slurm/munge programs: slurmctld, slurmd" in problems[1]
    assert "apt-get install slurmctld slurmd slurm-client munge" in problems[1]


def test_up_with_slurm_launcher_refuses_and_points_to_local(laptop, tmp_path, capsys):
    assert Stack(tmp_path / "state").up(launcher="slurm", timeout_s=1) == 2
    out = capsys.readouterr().out
    assert "cannot start a local Slurm cluster: not running as root" in out
    assert "hpcserve up --launcher local" in out
    assert not (tmp_path / "state").exists(), "a refused `up` changes nothing"
