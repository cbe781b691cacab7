"""Where replicas run: Slurm jobs (the product) or local processes (`--launcher local`).

The local launcher exists for machines without Slurm or root (a laptop): it runs
the very same rendered job script with bash, as a child process, and reports its
children in the SlurmClient's terms, so the pool manager cannot tell the difference.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from hpcserve.config import PlatformConfig
from hpcserve.slurm.client import SlurmClient, SlurmError, make_slurm_client
from hpcserve.slurm.parse import JobState, SlurmJob, SlurmNode, SqueueSnapshot

log = logging.getLogger(__name__)

_SBATCH_OPTION = re.compile(r"^#SBATCH --(?P<key>[a-z-]+)=(?P<value>\S+)$", re.MULTILINE)


def make_launcher(config: PlatformConfig) -> SlurmClient:
    if config.poolmgr.launcher == "local":
        return LocalLauncher(Path(config.slurm.log_dir or Path(config.state_dir) / "jobs"))
    env = dict(os.environ)
    if config.slurm.conf:
        env["SLURM_CONF"] = config.slurm.conf
    return make_slurm_client(env)


class _LocalJob:
    def __init__(self, job_id: int, name: str, comment: str, proc: subprocess.Popen[bytes]):
        self.job_id = job_id
        self.name = name
        self.comment = comment
        self.proc = proc
        self.submit_time = int(time.time())

    def as_slurm_job(self) -> SlurmJob:
        code = self.proc.poll()
        state = (
            JobState.RUNNING
            if code is None
            else (JobState.COMPLETED if code == 0 else JobState.FAILED)
        )
        return SlurmJob(
            job_id=self.job_id,
            name=self.name,
            state=state,
            state_reason="None",
            nodes=["localhost"],
            partition="local",
            comment=self.comment,
            submit_time=self.submit_time,
            start_time=self.submit_time,
            time_limit_s=None,
            end_time=None,
            batch_host="localhost",
        )


class LocalLauncher:
    """SlurmClient over local processes: each "job" is `bash script` in its own session."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._jobs: dict[int, _LocalJob] = {}
        self._ids = itertools.count(1)

    def submit(self, script: str, *, extra_args: Sequence[str] = ()) -> int:
        options = {m["key"]: m["value"] for m in _SBATCH_OPTION.finditer(script)}
        job_id = next(self._ids)
        name = options.get("job-name", "local")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}-local{job_id}.sh"
        path.write_text(script)
        # The job number goes where Slurm puts its job id, so replicas map to jobs alike.
        env = {**os.environ, "SLURM_JOB_ID": str(job_id)}
        with open(self.log_dir / f"{name}-local{job_id}.out", "ab") as out:
            proc = subprocess.Popen(
                ["bash", str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self._jobs[job_id] = _LocalJob(job_id, name, options.get("comment", ""), proc)
        return job_id

    def jobs(self, *, name_prefix: str | None = None) -> SqueueSnapshot:
        jobs = [
            j.as_slurm_job()
            for j in self._jobs.values()
            if name_prefix is None or j.name.startswith(name_prefix)
        ]
        for job in jobs:
            if not job.state.is_active:
                del self._jobs[job.job_id]
        return SqueueSnapshot(release="local", jobs=jobs)

    def cancel(
        self, job_ids: Sequence[int], *, signal: str | None = None, batch_only: bool = False
    ) -> None:
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None or job.proc.poll() is not None:
                continue
            if batch_only:
                job.proc.send_signal(_signal_number(signal or "TERM"))
            else:
                os.killpg(job.proc.pid, _signal_number(signal or "TERM"))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Drain every job (USR1 to its script), then kill what is left."""
        live = [j for j in self._jobs.values() if j.proc.poll() is None]
        for job in live:
            job.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        for job in live:
            try:
                job.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("local job %d did not drain in time; killing it", job.job_id)
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()

    def nodes(self) -> list[SlurmNode]:
        return []

    def drain_node(self, node: str, reason: str) -> None:
        raise SlurmError(f"the local launcher has no node {node!r} to drain")

    def resume_node(self, node: str) -> None:
        raise SlurmError(f"the local launcher has no node {node!r} to resume")

    def release(self) -> str:
        return "local"


def _signal_number(name: str) -> signal.Signals:
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
