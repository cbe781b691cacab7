"""Table tests of the Slurm output parsers (recorded 22.05 output, hand-made 24.11 shapes,
small inline strings) and of SlurmCLI's argv shapes and errors with a fake runner."""

from __future__ import annotations

import json
import logging
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpcserve.slurm.client import SlurmCLI, SlurmClient, SlurmError, make_slurm_client
from hpcserve.slurm.parse import (
    JobState,
    SlurmParseError,
    expand_hostlist,
    parse_release,
    parse_sbatch_parsable,
    parse_scontrol_show_node_json,
    parse_squeue_json,
)

DATA = Path(__file__).parent / "data" / "slurm"
R22 = DATA / "22.05"
R24 = DATA / "24.11"


def read(path: Path) -> str:
    return path.read_text()


# ---------------------------------------------------------------- sbatch --parsable


@pytest.mark.parametrize(
    ("stdout", "job_id"),
    [
        ("123", 123),
        ("123\n", 123),
        ("  77 \n", 77),
        ("123;cluster\n", 123),
        ("9;my-cluster", 9),
        (read(R22 / "sbatch_parsable.txt"), 1),
    ],
)
def test_parse_sbatch_parsable(stdout: str, job_id: int) -> None:
    assert parse_sbatch_parsable(stdout) == job_id


@pytest.mark.parametrize(
    "stdout",
    ["", "\n", "abc", "Submitted batch job 12", "12\n13\n", "12;", "12;a;b", "-3", "1 2"],
)
def test_parse_sbatch_parsable_rejects(stdout: str) -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_sbatch_parsable(stdout)
    assert repr(stdout) in str(info.value)


# ---------------------------------------------------------------- hostlists


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("", []),
        ("  ", []),
        ("(null)", []),
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("a1,b[1-3,5],c", ["a1", "b1", "b2", "b3", "b5", "c"]),
        ("n[01-03]", ["n01", "n02", "n03"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("gpu[01-02],gpu04", ["gpu01", "gpu02", "gpu04"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node-[3]-ib", ["node-3-ib"]),
        ("x[1-2], y", ["x1", "x2", "y"]),
        ("n[ 1 - 2 ]", ["n1", "n2"]),
    ],
)
def test_expand_hostlist(hostlist: str, names: list[str]) -> None:
    assert expand_hostlist(hostlist) == names


@pytest.mark.parametrize(
    ("hostlist", "snippet"),
    [
        ("n[1-", "n[1-"),
        ("n]1", "n]1"),
        ("n[3-1]", "3-1"),
        ("n[a-b]", "a-b"),
        ("n[[1]]", "n[[1]]"),
        ("a,,b", "a,,b"),
        ("a b", "a b"),
        ("n[1-2000000]", "n[1-2000000]"),
    ],
)
def test_expand_hostlist_rejects(hostlist: str, snippet: str) -> None:
    with pytest.raises(SlurmParseError, match="hostlist") as info:
        expand_hostlist(hostlist)
    assert snippet in str(info.value)


# ---------------------------------------------------------------- job states


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("RUNNING", JobState.RUNNING),
        ("running", JobState.RUNNING),
        ("PENDING", JobState.PENDING),
        ("COMPLETING", JobState.COMPLETING),
        (["RUNNING"], JobState.RUNNING),
        (["PENDING"], JobState.PENDING),
        (["COMPLETED", "COMPLETING"], JobState.COMPLETING),
        (["CANCELLED", "COMPLETING"], JobState.COMPLETING),
        (["RUNNING", "CONFIGURING"], JobState.CONFIGURING),
        (["PENDING", "REQUEUED"], JobState.REQUEUED),
        (["PENDING", "REQUEUE_HOLD"], JobState.REQUEUED),
        (["RUNNING", "SIGNALING"], JobState.RUNNING),
        (["OUT_OF_MEMORY"], JobState.OUT_OF_MEMORY),
        (["NODE_FAIL"], JobState.NODE_FAIL),
        ("TIMEOUT", JobState.TIMEOUT),
        ("DEADLINE", JobState.DEADLINE),
        ("BOOT_FAIL", JobState.BOOT_FAIL),
        ("PREEMPTED", JobState.PREEMPTED),
        ("SUSPENDED", JobState.SUSPENDED),
        ("SOMETHING_NEW", JobState.UNKNOWN),
        (["SOMETHING_NEW"], JobState.UNKNOWN),
        ([], JobState.UNKNOWN),
        (None, JobState.UNKNOWN),
        (7, JobState.UNKNOWN),
    ],
)
def test_job_state_parse(raw: object, state: JobState) -> None:
    assert JobState.parse(raw) is state


ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED"}


@pytest.mark.parametrize("state", list(JobState))
def test_job_state_is_active(state: JobState) -> None:
    assert state.is_active is (state.value in ACTIVE)


# ---------------------------------------------------------------- squeue --json files

# (job_id, name, state, reason, nodes, time_limit_s, start_time set?, end_time set?, batch_host)
SQUEUE_FILES = [
    (R22 / "squeue_empty.json", "22.05.8", []),
    (
        R22 / "squeue_pending_running.json",
        "22.05.8",
        [
            (1, "hpcserve-big-0", JobState.RUNNING, "None", ["n1"], 1800, True, True, "n1"),
            (2, "hpcserve-big-1", JobState.RUNNING, "None", ["n2"], 1800, True, True, "n2"),
            (3, "hpcserve-big-2", JobState.PENDING, "Resources", [], 1800, True, True, ""),
            (4, "admin-debug", JobState.PENDING, "Priority", [], 86400, True, True, ""),
        ],
    ),
    (
        R22 / "squeue_held.json",
        "22.05.8",
        [
            (1, "hpcserve-big-0", JobState.CANCELLED, "None", ["n1"], 1800, True, True, "n1"),
            (2, "hpcserve-big-1", JobState.RUNNING, "None", ["n2"], 1800, True, True, "n2"),
            (3, "hpcserve-big-2", JobState.RUNNING, "None", ["n1"], 1800, True, True, "n1"),
            (4, "admin-debug", JobState.PENDING, "Resources", [], 86400, True, True, ""),
            (5, "hpcserve-held-0", JobState.PENDING, "JobHeldUser", [], None, False, False, ""),
        ],
    ),
    (
        R22 / "squeue_two_node_running_and_failed.json",
        "22.05.8",
        [
            # no --time in a MaxTime=INFINITE partition: 22.05 reports a year (525600 min)
            (1, "two-node", JobState.RUNNING, "None", ["n1", "n2"], 31536000, True, True, "n1"),
            (2, "fails", JobState.FAILED, "NonZeroExitCode", ["n1"], 31536000, True, True, "n1"),
        ],
    ),
    (
        R22 / "squeue_finished.json",
        "22.05.8",
        [
            (1, "two-node", JobState.COMPLETED, "None", ["n1", "n2"], 31536000, True, True, "n1"),
            (2, "fails", JobState.FAILED, "NonZeroExitCode", ["n1"], 31536000, True, True, "n1"),
        ],
    ),
    (
        R24 / "squeue.json",
        "24.11.5",
        [
            (
                101,
                "hpcserve-chat-0",
                JobState.RUNNING,
                "None",
                ["gpu01"],
                3600,
                True,
                True,
                "gpu01",
            ),
            (102, "hpcserve-chat-1", JobState.PENDING, "Resources", [], 3600, True, True, ""),
            (103, "hpcserve-held-0", JobState.PENDING, "JobHeldUser", [], None, False, False, ""),
            (
                104,
                "hpcserve-chat-2",
                JobState.COMPLETING,
                "None",
                ["gpu02"],
                3600,
                True,
                True,
                "gpu02",
            ),
            (
                105,
                "two-node",
                JobState.CONFIGURING,
                "None",
                ["gpu01", "gpu02", "gpu04"],
                None,
                True,
                False,
                "gpu01",
            ),
            (106, "requeued", JobState.REQUEUED, "BeginTime", [], 3600, True, True, ""),
            (
                107,
                "oom",
                JobState.OUT_OF_MEMORY,
                "OutOfMemory",
                ["gpu03"],
                3600,
                True,
                True,
                "gpu03",
            ),
            (108, "future-state", JobState.UNKNOWN, "None", [], 3600, False, False, ""),
        ],
    ),
]


@pytest.mark.parametrize(
    ("path", "release", "expected"),
    SQUEUE_FILES,
    ids=[f"{p.parent.name}/{p.name}" for p, _, _ in SQUEUE_FILES],
)
def test_parse_squeue_files(path: Path, release: str, expected: list[tuple]) -> None:
    snap = parse_squeue_json(read(path))
    assert snap.release == release
    got = [
        (
            j.job_id,
            j.name,
            j.state,
            j.state_reason,
            j.nodes,
            j.time_limit_s,
            j.start_time is not None,
            j.end_time is not None,
            j.batch_host,
        )
        for j in snap.jobs
    ]
    assert got == expected
    for job in snap.jobs:
        assert job.submit_time > 1_700_000_000
        assert job.partition
        if job.start_time is not None and job.end_time is not None:
            assert job.end_time >= job.start_time


def test_squeue_comments_and_bytes_input() -> None:
    snap = parse_squeue_json((R22 / "squeue_pending_running.json").read_bytes())
    comments = {j.job_id: j.comment for j in snap.jobs}
    assert comments[1] == "hpcserve:pool=big;model=tiny;nonce=1a2b3c4d"
    assert comments[4] == ""
    new = parse_squeue_json(read(R24 / "squeue.json"))
    assert new.jobs[0].comment == "hpcserve:pool=chat;model=tiny;nonce=0a1b2c3d"
    assert new.jobs[0].start_time == 1750000001
    assert new.jobs[0].end_time == 1750003601


def _doc(job: dict, meta: dict | None = None) -> str:
    return json.dumps(
        {
            "meta": {"Slurm": {"release": "22.05.8"}} if meta is None else meta,
            "errors": [],
            "jobs": [job],
        }
    )


def num(n: int, *, set_: bool = True, infinite: bool = False) -> dict:
    return {"set": set_, "infinite": infinite, "number": n}


# (raw job dict, field, expected value)
INLINE_JOBS = [
    ({"job_id": 5, "job_state": "RUNNING"}, "state", JobState.RUNNING),
    ({"job_id": 5, "job_state": ["RUNNING"]}, "state", JobState.RUNNING),
    ({"job_id": num(5), "job_state": ["PENDING"]}, "job_id", 5),
    ({"job_id": 5}, "state", JobState.UNKNOWN),
    ({"job_id": 5}, "name", ""),
    ({"job_id": 5}, "state_reason", "None"),
    ({"job_id": 5}, "nodes", []),
    ({"job_id": 5}, "submit_time", 0),
    ({"job_id": 5, "time_limit": 30}, "time_limit_s", 1800),
    ({"job_id": 5, "time_limit": None}, "time_limit_s", None),
    ({"job_id": 5, "time_limit": num(30)}, "time_limit_s", 1800),
    ({"job_id": 5, "time_limit": num(0, set_=False, infinite=True)}, "time_limit_s", None),
    ({"job_id": 5, "time_limit": num(0, set_=False)}, "time_limit_s", None),
    ({"job_id": 5, "time_limit": num(7, infinite=True)}, "time_limit_s", None),
    ({"job_id": 5, "time_limit": "45"}, "time_limit_s", 2700),
    ({"job_id": 5, "start_time": 0}, "start_time", None),
    ({"job_id": 5, "start_time": 1700000000}, "start_time", 1700000000),
    ({"job_id": 5, "start_time": num(1700000000)}, "start_time", 1700000000),
    ({"job_id": 5, "start_time": num(0)}, "start_time", None),
    ({"job_id": 5, "end_time": num(0, set_=False, infinite=True)}, "end_time", None),
    ({"job_id": 5, "submit_time": num(1700000001)}, "submit_time", 1700000001),
    ({"job_id": 5, "nodes": "n[1-2]"}, "nodes", ["n1", "n2"]),
    ({"job_id": 5, "nodes": {"list": "n[3-4]"}}, "nodes", ["n3", "n4"]),
    ({"job_id": 5, "nodes": None}, "nodes", []),
    ({"job_id": 5, "comment": "x"}, "comment", "x"),
    ({"job_id": 5, "comment": {"job": "y", "administrator": "z"}}, "comment", "y"),
    ({"job_id": 5, "comment": None}, "comment", ""),
    ({"job_id": 5, "batch_host": "n1"}, "batch_host", "n1"),
    ({"job_id": 5, "partition": "gpu"}, "partition", "gpu"),
    ({"job_id": 5, "state_reason": "Resources"}, "state_reason", "Resources"),
]


@pytest.mark.parametrize(("raw", "field", "value"), INLINE_JOBS)
def test_parse_squeue_inline(raw: dict, field: str, value: object) -> None:
    (job,) = parse_squeue_json(_doc(raw)).jobs
    assert getattr(job, field) == value


@pytest.mark.parametrize(
    ("meta", "release"),
    [
        ({"Slurm": {"release": "22.05.8"}}, "22.05.8"),
        ({"slurm": {"release": "24.11.5", "version": {"major": "24"}}}, "24.11.5"),
        ({"slurm": {"version": {"major": "24", "minor": "11", "micro": "1"}}}, "24.11.1"),
        ({"Slurm": {"version": {"major": 22, "minor": 5, "micro": 8}}}, "22.05.8"),
        ({}, ""),
        ({"slurm": "weird"}, ""),
    ],
)
def test_parse_release(meta: dict, release: str) -> None:
    assert parse_release({"meta": meta}) == release
    assert parse_squeue_json(_doc({"job_id": 1}, meta)).release == release


@pytest.mark.parametrize(
    ("text", "snippet"),
    [
        ("", "''"),
        ("garbage here", "garbage here"),
        ("squeue: error: Unable to contact slurm controller", "Unable to contact"),
        ("[1, 2]", "[1, 2]"),
        ('{"jobs": 5}', '{"jobs": 5}'),
        ('{"meta": {}}', '{"meta": {}}'),
        ('{"errors": [{"error": "boom"}], "jobs": []}', "boom"),
        ('{"jobs": ["x"]}', "'x'"),
        ('{"jobs": [{"name": "no id"}]}', "no id"),
        ('{"jobs": [{"job_id": 1, "nodes": "n[1-"}]}', "n[1-"),
        ("{" + '"a": 1,' * 500, '"a": 1'),
    ],
)
def test_parse_squeue_rejects(text: str, snippet: str) -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_squeue_json(text)
    message = str(info.value)
    assert snippet in message
    assert len(message) < 600


# ---------------------------------------------------------------- nodes

NODE_FILES = [
    (
        R22 / "sinfo_idle.json",
        [
            ("n1", ["IDLE"], "", "gpu:4", "gpu:0", 2, 0),
            ("n2", ["IDLE"], "", "gpu:4", "gpu:0", 2, 0),
        ],
    ),
    (
        R22 / "sinfo_drained.json",
        [
            ("n1", ["MIXED", "DRAIN"], "xid 79 (test)", "gpu:4", "gpu:4", 2, 1),
            ("n2", ["MIXED"], "", "gpu:4", "gpu:4", 2, 1),
        ],
    ),
    (
        R22 / "sinfo_idle_drained.json",
        [
            ("n1", ["IDLE"], "", "gpu:4", "gpu:0", 2, 0),
            ("n2", ["IDLE", "DRAIN"], "maintenance", "gpu:4", "gpu:0", 2, 0),
        ],
    ),
    (
        R24 / "scontrol_show_node.json",
        [
            ("gpu01", ["MIXED"], "", "gpu:4", "gpu:1(IDX:0)", 2, 1),
            ("gpu02", ["IDLE", "DRAIN"], "xid 79", "gpu:4", "gpu:0(IDX:N/A)", 2, 0),
            (
                "gpu03",
                ["MIXED", "DRAIN"],
                "draining for maintenance",
                "gpu:4",
                "gpu:4(IDX:0-3)",
                2,
                1,
            ),
            (
                "gpu04",
                ["DOWN", "NOT_RESPONDING"],
                "Not responding",
                "gpu:4",
                "gpu:0(IDX:N/A)",
                2,
                0,
            ),
        ],
    ),
]


@pytest.mark.parametrize(
    ("path", "expected"), NODE_FILES, ids=[f"{p.parent.name}/{p.name}" for p, _ in NODE_FILES]
)
def test_parse_node_files(path: Path, expected: list[tuple]) -> None:
    nodes = parse_scontrol_show_node_json(read(path))
    got = [(n.name, n.state, n.reason, n.gres, n.gres_used, n.cpus, n.alloc_cpus) for n in nodes]
    assert got == expected
    for node in nodes:
        assert node.drained is ("DRAIN" in node.state)
        assert node.down is ("DOWN" in node.state)
        assert node.partitions


SINFO_2311 = {
    "meta": {"slurm": {"release": "23.11.4"}},
    "errors": [],
    "sinfo": [
        {
            "node": {"state": ["IDLE", "DRAIN"]},
            "nodes": {"nodes": ["a1"]},
            "partition": {"name": "gpu"},
            "reason": "bad gpu",
            "gres": {"total": "gpu:4", "used": "gpu:0"},
            "cpus": {"allocated": 0, "total": 8, "maximum": 8},
        },
        {
            "node": {"state": ["IDLE", "DRAIN"]},
            "nodes": {"nodes": ["a1"]},
            "partition": {"name": "debug"},
            "reason": "bad gpu",
            "gres": {"total": "gpu:4", "used": "gpu:0"},
            "cpus": {"allocated": 0, "total": 8, "maximum": 8},
        },
        {
            "node": {"state": ["MIXED"]},
            "nodes": {"nodes": ["a2", "a3"]},
            "partition": {"name": "gpu"},
            "reason": "",
            "gres": {"total": "gpu:4", "used": "gpu:2"},
            "cpus": {"allocated": 4, "total": 16, "maximum": 8},
        },
    ],
}


def test_parse_sinfo_2311_shape() -> None:
    nodes = parse_scontrol_show_node_json(json.dumps(SINFO_2311))
    got = [(n.name, n.state, n.reason, n.partitions, n.cpus, n.alloc_cpus) for n in nodes]
    assert got == [
        ("a1", ["IDLE", "DRAIN"], "bad gpu", ["gpu", "debug"], 8, 0),
        ("a2", ["MIXED"], "", ["gpu"], 8, None),
        ("a3", ["MIXED"], "", ["gpu"], 8, None),
    ]


@pytest.mark.parametrize(
    ("text", "snippet"),
    [
        ("nope", "nope"),
        (read(R22 / "scontrol_show_node_json.stderr.txt"), "unrecognized option"),
        ('{"nodes": [{"state": "idle"}]}', "idle"),
        ('{"nodes": [7]}', "7"),
        ('{"sinfo": [{"node": {}}]}', "node"),
        ('{"sinfo": [3]}', "3"),
        ('{"partitions": []}', "partitions"),
        ('{"errors": [{"description": "Invalid node"}], "nodes": []}', "Invalid node"),
    ],
)
def test_parse_nodes_rejects(text: str, snippet: str) -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_scontrol_show_node_json(text)
    assert snippet in str(info.value)


# ---------------------------------------------------------------- SlurmCLI with a fake runner


class FakeRunner:
    """Answers argv by its first words; records (argv, stdin)."""

    def __init__(self, answers: dict[str, object]):
        self.answers = answers
        self.seen: list[tuple[list[str], str | None]] = []

    def __call__(self, argv: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
        self.seen.append((argv, stdin))
        for key in sorted(self.answers, key=len, reverse=True):
            if " ".join(argv).startswith(key):
                answer = self.answers[key]
                if isinstance(answer, BaseException):
                    raise answer
                rc, out, err = answer  # type: ignore[misc]
                return subprocess.CompletedProcess(argv, rc, out, err)
        raise AssertionError(f"unexpected command {argv}")


def cli(answers: dict[str, object]) -> tuple[SlurmCLI, FakeRunner]:
    runner = FakeRunner(answers)
    return SlurmCLI({"SLURM_CONF": "/x/slurm.conf"}, timeout_s=3, runner=runner), runner


SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:1\nsleep 30\n"


def test_cli_is_a_slurm_client() -> None:
    client, _ = cli({})
    assert isinstance(client, SlurmClient)


def test_submit_passes_script_on_stdin() -> None:
    client, runner = cli({"sbatch": (0, "42\n", "")})
    assert client.submit(SCRIPT, extra_args=["--hold", "--comment=a b"]) == 42
    assert runner.seen == [(["sbatch", "--parsable", "--hold", "--comment=a b"], SCRIPT)]
    assert client.calls["sbatch"] == 1


def test_submit_error_quotes_argv_and_stderr() -> None:
    err = "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification\n"
    client, _ = cli({"sbatch": (1, "", err)})
    with pytest.raises(SlurmError) as info:
        client.submit(SCRIPT, extra_args=["--gres=tpu:1"])
    msg = str(info.value)
    assert "sbatch --parsable --gres=tpu:1" in msg
    assert "Invalid generic resource (gres) specification" in msg
    assert "exit status: 1" in msg
    assert info.value.returncode == 1
    assert info.value.argv == ["sbatch", "--parsable", "--gres=tpu:1"]


def test_submit_unparsable_output_is_a_slurm_error() -> None:
    client, _ = cli({"sbatch": (0, "Submitted batch job 5\n", "")})
    with pytest.raises(SlurmError, match="Submitted batch job 5"):
        client.submit(SCRIPT)


def test_jobs_is_one_squeue_call_and_filters_by_prefix() -> None:
    client, runner = cli({"squeue": (0, read(R22 / "squeue_pending_running.json"), "")})
    snap = client.jobs(name_prefix="hpcserve-")
    assert [j.job_id for j in snap.jobs] == [1, 2, 3]
    assert snap.release == "22.05.8"
    assert [j.job_id for j in client.jobs().jobs] == [1, 2, 3, 4]
    assert [a for a, _ in runner.seen] == [["squeue", "--all", "--json"]] * 2
    assert client.calls == {"squeue": 2}
    # the release came with the snapshot: no extra call
    assert client.release() == "22.05.8"
    assert client.calls == {"squeue": 2}


def test_jobs_garbage_is_a_slurm_error_quoting_it() -> None:
    client, _ = cli({"squeue": (0, "<html>proxy error</html>", "")})
    with pytest.raises(SlurmError, match="proxy error") as info:
        client.jobs()
    assert "squeue --all --json" in str(info.value)


def test_jobs_failure_quotes_stderr() -> None:
    err = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"
    client, _ = cli({"squeue": (1, "", err)})
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        client.jobs()


@pytest.mark.parametrize(
    ("kwargs", "argv"),
    [
        ({}, ["scancel", "1", "2", "3"]),
        ({"signal": "USR1"}, ["scancel", "--signal=USR1", "1", "2", "3"]),
        (
            {"signal": "USR1", "batch_only": True},
            ["scancel", "--signal=USR1", "--batch", "1", "2", "3"],
        ),
    ],
)
def test_cancel_is_one_call(kwargs: dict, argv: list[str]) -> None:
    client, runner = cli({"scancel": (0, "", "")})
    client.cancel([1, 2, 3], **kwargs)
    assert runner.seen == [(argv, None)]
    assert client.calls == {"scancel": 1}


def test_cancel_nothing_makes_no_call() -> None:
    client, runner = cli({})
    client.cancel([])
    assert runner.seen == []


def test_cancel_batch_only_needs_a_signal() -> None:
    client, _ = cli({})
    with pytest.raises(ValueError, match="signal"):
        client.cancel([1], batch_only=True)


def test_cancel_ignores_jobs_already_gone() -> None:
    err = (
        "scancel: error: Kill job error on job id 7: Invalid job id specified\n"
        "scancel: error: Kill job error on job id 8: Job/step already completing or completed\n"
    )
    client, _ = cli({"scancel": (1, "", err)})
    client.cancel([7, 8], signal="USR1", batch_only=True)


def test_cancel_other_errors_raise() -> None:
    err = "scancel: error: Kill job error on job id 7: Access/permission denied\n"
    client, _ = cli({"scancel": (1, "", err)})
    with pytest.raises(SlurmError, match="Access/permission denied") as info:
        client.cancel([7])
    assert "scancel 7" in str(info.value)


def test_nodes_falls_back_to_sinfo_on_2205_once() -> None:
    client, runner = cli(
        {
            "scontrol show node --json": (1, "", read(R22 / "scontrol_show_node_json.stderr.txt")),
            "sinfo --json": (0, read(R22 / "sinfo_idle_drained.json"), ""),
        }
    )
    assert [(n.name, n.drained) for n in client.nodes()] == [("n1", False), ("n2", True)]
    client.nodes()
    assert [a for a, _ in runner.seen] == [
        ["scontrol", "show", "node", "--json"],
        ["sinfo", "--json"],
        ["sinfo", "--json"],
    ]


def test_nodes_uses_scontrol_json_on_newer_releases() -> None:
    client, _ = cli({"scontrol show node --json": (0, read(R24 / "scontrol_show_node.json"), "")})
    assert [n.name for n in client.nodes()] == ["gpu01", "gpu02", "gpu03", "gpu04"]
    client.nodes()
    assert client.calls == {"scontrol": 2}


def test_nodes_other_failure_raises() -> None:
    client, _ = cli({"scontrol": (1, "", "scontrol: error: slurm_load_node: Unable to contact")})
    with pytest.raises(SlurmError, match="slurm_load_node"):
        client.nodes()


def test_drain_and_resume_argv() -> None:
    client, runner = cli({"scontrol update": (0, "", "")})
    client.drain_node("n1", "xid 79; ecc")
    client.resume_node("n1")
    assert [a for a, _ in runner.seen] == [
        ["scontrol", "update", "nodename=n1", "state=drain", "reason=xid 79; ecc"],
        ["scontrol", "update", "nodename=n1", "state=resume"],
    ]
    with pytest.raises(ValueError, match="reason"):
        client.drain_node("n1", " ")


def test_drain_error_quotes_slurm() -> None:
    client, _ = cli({"scontrol update": (1, "", "slurm_update error: Invalid node name specified")})
    with pytest.raises(SlurmError, match="Invalid node name specified") as info:
        client.drain_node("n9", "x")
    assert "scontrol update nodename=n9 state=drain reason=x" in str(info.value)


@pytest.mark.parametrize(
    ("stdout", "release"),
    [
        (read(R22 / "sbatch_version.txt"), "22.05.8"),
        ("slurm 24.11.1\n", "24.11.1"),
        ("slurm 25.05.0-0rc1\n", "25.05.0"),
    ],
)
def test_release_asks_once(stdout: str, release: str) -> None:
    client, runner = cli({"sbatch --version": (0, stdout, "")})
    assert client.release() == release
    assert client.release() == release
    assert len(runner.seen) == 1


def test_release_unreadable() -> None:
    client, _ = cli({"sbatch --version": (0, "who knows\n", "")})
    with pytest.raises(SlurmError, match="who knows"):
        client.release()


def test_timeout_names_the_setting() -> None:
    timeout = subprocess.TimeoutExpired(["squeue"], 3, output=b"partial", stderr=b"")
    client, _ = cli({"squeue": timeout})
    with pytest.raises(SlurmError) as info:
        client.jobs()
    msg = str(info.value)
    assert "timeout_s" in msg and "3 s" in msg
    assert "squeue --all --json" in msg
    assert "partial" in msg


def test_missing_binary_is_a_slurm_error() -> None:
    client, _ = cli({"sbatch": FileNotFoundError(2, "No such file or directory", "sbatch")})
    with pytest.raises(SlurmError, match="slurm-client"):
        client.submit(SCRIPT)


# ---------------------------------------------------------------- the real subprocess runner


def _fake_tools(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tools = {
        "sbatch": '#!/bin/sh\ncat > "$FAKE_DIR/stdin.txt"\necho "$@" > "$FAKE_DIR/args.txt"\n'
        'echo "$SLURM_CONF" > "$FAKE_DIR/conf.txt"\necho "77;c"\n',
        "squeue": f'#!/bin/sh\ncat "{R22 / "squeue_held.json"}"\n',
        "scancel": "#!/bin/sh\nsleep 5\n",
    }
    for name, text in tools.items():
        path = bindir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path), "SLURM_CONF": "/c/s.conf"}


def test_subprocess_runner_env_stdin_and_timeout(tmp_path: Path) -> None:
    client = SlurmCLI(_fake_tools(tmp_path), timeout_s=0.5)
    assert client.submit(SCRIPT, extra_args=["-J", "x y"]) == 77
    assert (tmp_path / "stdin.txt").read_text() == SCRIPT
    assert (tmp_path / "args.txt").read_text() == "--parsable -J x y\n"
    assert (tmp_path / "conf.txt").read_text() == "/c/s.conf\n"
    assert len(client.jobs(name_prefix="hpcserve-held").jobs) == 1
    with pytest.raises(SlurmError, match=r"0\.5 s"):
        client.cancel([1])


# ---------------------------------------------------------------- make_slurm_client


def test_make_client_default_is_cli() -> None:
    assert isinstance(make_slurm_client({"SLURM_CONF": "/x"}), SlurmCLI)


def test_make_client_pyslurm_absent_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING, logger="hpcserve.slurm.client"):
        client = make_slurm_client({}, prefer_pyslurm=True)
    assert isinstance(client, SlurmCLI)
    assert len(caplog.records) == 1
    assert "pyslurm" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("py_version", "release", "words"),
    [
        ("25.11.0", "22.05.8", "does not match"),
        ("24.11.0", "24.11.5", "no pyslurm backend"),
    ],
)
def test_make_client_pyslurm_version(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    py_version: str,
    release: str,
    words: str,
) -> None:
    fake = type(sys)("pyslurm")
    fake.__version__ = py_version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    monkeypatch.setattr(SlurmCLI, "release", lambda self: release)
    with caplog.at_level(logging.WARNING, logger="hpcserve.slurm.client"):
        client = make_slurm_client({}, prefer_pyslurm=True)
    assert isinstance(client, SlurmCLI)
    assert len(caplog.records) == 1
    assert words in caplog.records[0].getMessage()
    assert py_version in caplog.records[0].getMessage()
