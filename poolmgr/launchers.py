"""Where replicas run: Slurm jobs (the product) or local processes (`--launcher local`).

The local launcher exists for machines without Slurm or root (a laptop): it runs
the very same rendered job script with bash, as a child process, and reports its
children in the SlurmClient's terms, so the pool manager cannot tell the difference.

For rehearsals and benchmarks (bench/autoscale_day.py) it can stand in for Slurm's queue
wait too (`poolmgr.local_queue_wait_s`): each job then stays PENDING (reason Priority) for a
time drawn from an exponential distribution of that mean, seeded by `poolmgr.local_queue_seed`
and the job's number (the n-th job of two runs waits alike), and starts at the first
`jobs()` call after it; a pending job cancelled never starts.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
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
        return LocalLauncher(
            Path(config.slurm.log_dir or Path(config.state_dir) / "jobs"),
            queue_wait_s=config.poolmgr.local_queue_wait_s,
            queue_seed=config.poolmgr.local_queue_seed,
        )
    env = dict(os.environ)
    if config.slurm.conf:
        env["SLURM_CONF"] = config.slurm.conf
    return make_slurm_client(env)


def queue_wait(mean_s: float, seed: int, job_id: int) -> float:
    """The local launcher's stand-in for Slurm's queue wait of job `job_id`: exponential
    with mean `mean_s` (0: none), the same for the same seed and job number."""
    if mean_s <= 0:
        return 0.0
    return random.Random(f"{seed}:{job_id}").expovariate(1 / mean_s)


class _LocalJob:
    def __init__(self, job_id: int, name: str, comment: str, start_at: float) -> None:
        self.job_id = job_id
        self.name = name
        self.comment = comment
        self.submit_time = int(time.time())
        self.start_at = start_at  # time.time() when its (simulated) queue wait ends
        self.start_time: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None  # None: pending (or cancelled)
        self.cancelled = False  # cancelled (not signalled): ends CANCELLED, as with scancel

    def as_slurm_job(self) -> SlurmJob:
        code = self.proc.poll() if self.proc is not None else None
        if self.proc is None:
            state = JobState.CANCELLED if self.cancelled else JobState.PENDING
        elif code is None:
            state = JobState.RUNNING
        elif self.cancelled:  # as scancel: killed on request, not failed
            state = JobState.CANCELLED
        else:
            state = JobState.COMPLETED if code == 0 else JobState.FAILED
        running = self.proc is not None
        return SlurmJob(
            job_id=self.job_id,
            name=self.name,
            state=state,
            state_reason="None" if running or self.cancelled else "Priority",
            nodes=["localhost"] if running else [],
            partition="local",
            comment=self.comment,
            submit_time=self.submit_time,
            start_time=self.start_time,
            time_limit_s=None,
            end_time=None,
            batch_host="localhost" if running else "",
        )


class LocalLauncher:
    """SlurmClient over local processes: each "job" is `bash script` in its own session."""

    def __init__(self, log_dir: Path, *, queue_wait_s: float = 0.0, queue_seed: int = 0) -> None:
        """queue_wait_s: the mean of the simulated queue wait (module doc); 0: none."""
        self.log_dir = log_dir
        self.queue_wait_s = queue_wait_s
        self.queue_seed = queue_seed
        self._jobs: dict[int, _LocalJob] = {}
        self._ids = itertools.count(1)

    def submit(self, script: str, *, extra_args: Sequence[str] = ()) -> int:
        options = {m["key"]: m["value"] for m in _SBATCH_OPTION.finditer(script)}
        job_id = next(self._ids)
        name = options.get("job-name", "local")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}-local{job_id}.sh"
        path.write_text(script)
        wait = queue_wait(self.queue_wait_s, self.queue_seed, job_id)
        job = _LocalJob(job_id, name, options.get("comment", ""), time.time() + wait)
        self._jobs[job_id] = job
        if not wait:
            self._start(job)
        return job_id

    def _start(self, job: _LocalJob) -> None:
        path = self.log_dir / f"{job.name}-local{job.job_id}.sh"
        # The job number goes where Slurm puts its job id, so replicas map to jobs alike.
        env = {**os.environ, "SLURM_JOB_ID": str(job.job_id)}
        with open(self.log_dir / f"{job.name}-local{job.job_id}.out", "ab") as out:
            job.proc = subprocess.Popen(
                ["bash", str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        job.start_time = int(time.time())

    def jobs(self, *, name_prefix: str | None = None) -> SqueueSnapshot:
        now = time.time()
        for local in self._jobs.values():  # those whose queue wait is over start now
            if local.proc is None and not local.cancelled and local.start_at <= now:
                self._start(local)
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
            if job is not None and job.proc is None:  # still in its queue wait: never starts
                job.cancelled = True
                continue
            if job is None or job.proc is None or job.proc.poll() is not None:
                continue
            if batch_only:
                job.proc.send_signal(_signal_number(signal or "TERM"))
            else:
                job.cancelled = signal is None  # a cancellation, not just a signal
                os.killpg(job.proc.pid, _signal_number(signal or "TERM"))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Drain every job (USR1 to its script), then kill what is left."""
        for job in self._jobs.values():
            if job.proc is None:  # pending: never starts
                job.cancelled = True
        live = [j for j in self._jobs.values() if j.proc is not None and j.proc.poll() is None]
        for job in live:
            assert job.proc is not None
            job.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        for job in live:
            assert job.proc is not None
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

    def topology(self) -> dict[str, str]:
        return {}  # one host: no switches


def _signal_number(name: str) -> signal.Signals:
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
