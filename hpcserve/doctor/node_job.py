"""The doctor's short Slurm job: it runs `hpcserve doctor --node-request R --node-result F`
on a GPU node (with the GPUs a pool's replica asks for), which gathers the node's facts
into F; the control node waits for the job with one squeue per poll and judges the facts.

Request and result travel through `<state_dir>/doctor/` (owner-only), which must be on the
filesystem the nodes share, as the engines' manifests and keys already are. Only paths go
in the request; no secret enters the script, its environment or its output.
"""

from __future__ import annotations

import secrets
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from hpcserve.config import PlatformConfig, PoolConfig
from hpcserve.contracts.private_files import private_dir, write_private
from hpcserve.doctor.gather import NodeRequest, probe_args
from hpcserve.doctor.types import NodeFacts, SlurmTimes
from hpcserve.slurm.client import SlurmCLI, SlurmError
from hpcserve.slurm.parse import JobState, SlurmJob

JOB_TIME_MIN = 10
POLL_S = 1.0


class NodeRun(msgspec.Struct):
    """One doctor job: where it was asked to run, and what came back."""

    target: str  # a node name, or "" for wherever Slurm puts it
    job_id: int = 0
    facts: NodeFacts | None = None
    times: SlurmTimes | None = None
    error: str = ""  # why no facts came back
    fix: str = ""


def _doctor_pool(config: PlatformConfig) -> PoolConfig | None:
    """The pool the doctor's job looks like: the one asking the most GPUs per node."""
    return max(config.pools, key=lambda p: p.gpus_per_replica, default=None)


def doctor_job_args(config: PlatformConfig, output: str, target: str) -> list[str]:
    """sbatch options: a replica-shaped request (the largest per-node GPU count of the
    pools, on that pool's partition), one task, a short time limit."""
    pool = _doctor_pool(config)
    partition = config.slurm.partition
    if pool is not None and pool.role == "batch" and config.slurm.batch_partition:
        partition = config.slurm.batch_partition
    gpus = pool.gpus_per_replica if pool is not None else 0
    args = [
        f"--job-name={config.poolmgr.job_name_prefix}-doctor",
        "--ntasks=1",
        f"--output={output}",
        *probe_args(config, partition, gpus, 1),
    ]
    args = [a for a in args if not a.startswith("--time=")] + [f"--time={JOB_TIME_MIN}"]
    if target:
        args.append(f"--nodelist={target}")
    return args


_MODULE_INIT = """if ! type module >/dev/null 2>&1; then
  for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do
    if [ -r "$init" ]; then . "$init"; break; fi
  done
fi
"""


def doctor_script(config: PlatformConfig, hpcserve_bin: str, request: Path, result: Path) -> str:
    """The job: the engines' environment modules and launch prefix (a container), then
    `hpcserve doctor` in node mode, so it sees what an engine of the pool would."""
    pool = _doctor_pool(config)
    prefix = config.pool_launch_prefix(pool) if pool is not None else config.engine.launch_prefix
    modules = config.pool_modules(pool) if pool is not None else config.engine.modules
    argv = [
        *prefix,
        config.engine.hpcserve_bin or hpcserve_bin,
        "doctor",
        "--node-request",
        str(request),
        "--node-result",
        str(result),
    ]
    lines = [
        "#!/bin/bash",
        "# hpcserve doctor: gathers this GPU node's facts for the control node to check.",
    ]
    if modules:
        lines.append(_MODULE_INIT + f"module load {shlex.join(modules)} || exit 1")
    lines.append(f"exec {shlex.join(argv)}")
    return "\n".join(lines) + "\n"


def run_node_jobs(
    config: PlatformConfig,
    client: SlurmCLI,
    request: NodeRequest,
    targets: list[str],
    *,
    hpcserve_bin: str,
    timeout_s: float,
    say: Callable[[str], None],
) -> list[NodeRun]:
    """Submit one doctor job per target ("" = anywhere), wait for all, read their facts."""
    work = private_dir(Path(config.state_dir) / "doctor" / secrets.token_hex(6))
    request_path = work / "request.json"
    write_private(request_path, msgspec.json.encode(request))
    runs: list[NodeRun] = []
    for i, target in enumerate(targets):
        run = NodeRun(target=target)
        runs.append(run)
        script = doctor_script(config, hpcserve_bin, request_path, work / f"result-{i}.json")
        try:
            run.job_id = client.submit(
                script, extra_args=doctor_job_args(config, str(work / f"job-{i}-%j.out"), target)
            )
        except SlurmError as err:
            run.error = f"the doctor job was refused: {err}"
            run.fix = "see the slurm_access and gres checks"
            continue
        say(f"submitted doctor job {run.job_id}" + (f" to node {target}" if target else ""))
    results = {r.job_id: work / f"result-{i}.json" for i, r in enumerate(runs)}
    _wait(client, [r for r in runs if r.job_id], results, timeout_s, say)
    for i, run in enumerate(runs):
        if run.job_id and not run.error:
            _read_result(run, work / f"result-{i}.json", work, i)
    if all(run.facts is not None for run in runs):
        shutil.rmtree(work, ignore_errors=True)  # kept, with the jobs' output, on a failure
    return runs


def _wait(
    client: SlurmCLI,
    runs: list[NodeRun],
    results: dict[int, Path],
    timeout_s: float,
    say: Callable[[str], None],
) -> None:
    """Until every job has ended (one squeue per poll): a job is done once Slurm lists it
    finished, or once it is no longer listed and its result is there (a site with a short
    MinJobAge forgets finished jobs fast)."""
    deadline = time.monotonic() + timeout_s
    next_report = time.monotonic() + 15
    pending = {r.job_id: r for r in runs}
    last: dict[int, SlurmJob] = {}
    while pending:
        try:
            seen = {j.job_id: j for j in client.jobs().jobs if j.job_id in pending}
        except SlurmError as err:  # a failed status read is retried, not fatal
            say(f"squeue failed (retrying): {err}")
            seen = {}
        for job_id, run in list(pending.items()):
            job = seen.get(job_id)
            if job is not None:
                last[job_id] = job
                run.times = _times(job, run.times)
                if job.is_active:
                    continue
            elif job_id not in last and not results[job_id].exists():
                continue  # not listed yet
            del pending[job_id]
        if not pending:
            return
        if time.monotonic() > deadline:
            for job_id, run in pending.items():
                job = last.get(job_id)
                state = f"{job.state.value} ({job.state_reason})" if job else "not listed"
                run.error = f"job {job_id} still {state} after {timeout_s:g} s; cancelled"
                run.fix = (
                    "a GPU node must be free for a few minutes: run it again with a longer "
                    "--node-timeout, or on a named idle node (--node NODE)"
                )
            try:
                client.cancel(list(pending))
            except SlurmError as err:
                say(f"could not cancel {', '.join(map(str, pending))}: {err}")
            return
        if time.monotonic() >= next_report:
            states = ", ".join(_job_state(last[j]) for j in pending if j in last)
            say(f"waiting for doctor job(s) {states or ', '.join(map(str, pending))}")
            next_report = time.monotonic() + 15
        time.sleep(POLL_S)


def _times(job: SlurmJob, known: SlurmTimes | None) -> SlurmTimes:
    """slurmctld's stamps, only once they are facts: a pending job's start and a running
    job's end are estimates."""
    start = None if job.state is JobState.PENDING else job.start_time
    end = None if job.is_active else job.end_time
    if known is not None:
        start = start if start is not None else known.start_time
    return SlurmTimes(start_time=start, end_time=end)


def _job_state(job: SlurmJob) -> str:
    reason = job.state_reason if job.state_reason not in ("", "None") else ""
    return f"{job.job_id}: {job.state.value}" + (f" ({reason})" if reason else "")


def _read_result(run: NodeRun, path: Path, work: Path, index: int) -> None:
    try:
        run.facts = msgspec.json.decode(path.read_bytes(), type=NodeFacts)
        return
    except FileNotFoundError:
        pass
    except (OSError, msgspec.DecodeError) as err:
        run.error = f"cannot read the job's result {path}: {err}"
        return
    outputs = sorted(work.glob(f"job-{index}-*.out"))
    tail = ""
    if outputs:
        lines = outputs[0].read_text(errors="replace").strip().splitlines()[-5:]
        tail = " | ".join(lines)
    run.error = f"job {run.job_id} ended without a result" + (
        f"; its output: {tail}" if tail else f"; no output in {work}"
    )
    run.fix = (
        f"the job reads and writes {work}: state_dir must be on the filesystem the GPU nodes "
        "share, and the hpcserve install (or launch prefix) must exist on the nodes"
    )
