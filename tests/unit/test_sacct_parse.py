"""sacct's parsable output (slurm/parse.py parse_sacct) and the client's one sacct call."""

from __future__ import annotations

import subprocess
import time

import pytest

from hpcserve.slurm.client import SlurmCLI, SlurmError
from hpcserve.slurm.parse import (
    SACCT_FIELDS,
    AccountedJob,
    JobState,
    SlurmParseError,
    alloc_gpus,
    parse_sacct,
)

# Seen from Slurm 22.05.8 with slurmdbd (hpcserve/local_accounting.py), SLURM_TIME_FORMAT=%s.
REAL_2205 = (
    "27717001|gpu|COMPLETED|1796163617|1796163620|billing=1,cpu=1,gres/gpu=2,node=1|1|"
    "hpcserve-chat\n"
    "27717002|gpu|CANCELLED by 0|1796163617|1796163625|billing=1,cpu=1,gres/gpu=1,node=1|1|other\n"
)


def _job(job_id: int, name: str, state: JobState, start: int | None, end: int | None, gpus: int | None, nodes: int = 1, partition: str = "gpu") -> AccountedJob:  # fmt: skip
    return AccountedJob(job_id, name, partition, state, start, end, gpus, nodes)


@pytest.mark.parametrize(
    ("text", "jobs"),
    [
        pytest.param(
            REAL_2205,
            [
                _job(27717001, "hpcserve-chat", JobState.COMPLETED, 1796163617, 1796163620, 2),
                _job(27717002, "other", JobState.CANCELLED, 1796163617, 1796163625, 1),
            ],
            id="22.05",
        ),
        pytest.param(
            "41|gpu|RUNNING|1796163617|Unknown|billing=4,cpu=4,gres/gpu=4,node=2|2|hpcserve-big\n"
            "42|gpu|PENDING|Unknown|Unknown||0|hpcserve-big\n",
            [
                _job(41, "hpcserve-big", JobState.RUNNING, 1796163617, None, 4, nodes=2),
                _job(42, "hpcserve-big", JobState.PENDING, None, None, None, nodes=0),
            ],
            id="running-and-pending",
        ),
        pytest.param(
            "7|a100|TIMEOUT|100|200|cpu=8,gres/gpu:a100=2,gres/gpu:h100=1,mem=8G|1|x|y\n",
            [_job(7, "x|y", JobState.TIMEOUT, 100, 200, 3, partition="a100")],
            id="typed-gpus-and-a-bar-in-the-name",
        ),
        pytest.param(
            "8|gpu|COMPLETED|100|200|cpu=8,mem=8G,node=1|1|no-gpu-tres\n"
            "8.batch||COMPLETED|100|200|cpu=8|1|batch\n\n",
            [_job(8, "no-gpu-tres", JobState.COMPLETED, 100, 200, None)],
            id="no-gres-tres-and-a-step",
        ),
        pytest.param("", [], id="empty"),
    ],
)
def test_parse_sacct(text: str, jobs: list[AccountedJob]) -> None:
    assert parse_sacct(text) == jobs


def test_parse_sacct_reads_slurms_default_iso_times_as_local_time() -> None:
    (job,) = parse_sacct("9|gpu|COMPLETED|2026-12-01T10:00:00|2026-12-01T11:30:00|gres/gpu=1|1|j\n")
    assert job.end is not None and job.start is not None
    assert job.end - job.start == 5400
    assert job.start == int(time.mktime((2026, 12, 1, 10, 0, 0, 0, 0, -1)))


@pytest.mark.parametrize(
    ("text", "snippet"),
    [
        ("1|gpu|COMPLETED|100\n", "fields"),
        ("abc|gpu|COMPLETED|100|200|gres/gpu=1|1|j\n", "not a number"),
        ("1|gpu|COMPLETED|yesterday|200|gres/gpu=1|1|j\n", "yesterday"),
    ],
)
def test_parse_sacct_rejects(text: str, snippet: str) -> None:
    with pytest.raises(SlurmParseError, match=snippet):
        parse_sacct(text)


@pytest.mark.parametrize(
    ("tres", "gpus"),
    [
        ("billing=1,cpu=1,gres/gpu=2,node=1", 2),
        ("gres/gpu=2,gres/gpu:a100=2", 2),
        ("gres/gpu:a100=1,gres/gpu:v100=2", 3),
        ("cpu=4,mem=1G", None),
        ("", None),
    ],
)
def test_alloc_gpus(tres: str, gpus: int | None) -> None:
    assert alloc_gpus(tres) == gpus


class _Runner:
    def __init__(self, stdout: str, returncode: int = 0, stderr: str = "") -> None:
        self.result = (returncode, stdout, stderr)
        self.argv: list[str] = []

    def __call__(self, argv: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        self.argv = argv
        rc, out, err = self.result
        return subprocess.CompletedProcess(argv, rc, out, err)


def test_accounting_is_one_sacct_call_for_every_user_and_allocation() -> None:
    runner = _Runner(REAL_2205)
    cli = SlurmCLI({}, runner=runner)
    jobs = cli.accounting(1796160000, 1796170000)
    assert [j.job_id for j in jobs] == [27717001, 27717002]
    assert cli.calls["sacct"] == 1
    argv = runner.argv
    assert argv[0] == "sacct" and {"--allusers", "--allocations", "--parsable2"} <= set(argv)
    assert f"--format={','.join(SACCT_FIELDS)}" in argv
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(1796160000))
    assert f"--starttime={start}" in argv
    assert cli.env["SLURM_TIME_FORMAT"] == "%s"


def test_accounting_without_slurmdbd_quotes_sacct() -> None:
    stderr = "sacct: error: Slurm accounting storage is disabled\n"
    cli = SlurmCLI({}, runner=_Runner("", 1, stderr))
    with pytest.raises(SlurmError, match="accounting storage is disabled"):
        cli.accounting(0, 1)
