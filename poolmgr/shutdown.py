"""Stop every hpcserve job gracefully: drain the running ones, cancel the pending ones."""

from __future__ import annotations

import time
from collections.abc import Callable

from hpcserve.config import PlatformConfig
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.slurm.client import SlurmClient
from hpcserve.slurm.parse import JobState


def drain_all_jobs(client: SlurmClient, config: PlatformConfig, say: Callable[[str], None]) -> None:
    prefix = config.poolmgr.job_name_prefix + "-"

    def ours() -> list:
        return [
            j
            for j in client.jobs(name_prefix=prefix).jobs
            if j.state.is_active and parse_comment(j.comment) is not None
        ]

    jobs = ours()
    if not jobs:
        return
    pending = [j.job_id for j in jobs if j.state is JobState.PENDING]
    running = [j.job_id for j in jobs if j.state is not JobState.PENDING]
    if pending:
        client.cancel(pending)
    if running:
        say(f"draining jobs {', '.join(map(str, running))} (up to {config.slurm.drain_s}s)")
        client.cancel(running, signal="USR1", batch_only=True)
    deadline = time.monotonic() + config.slurm.drain_s + 20
    while (left := ours()) and time.monotonic() < deadline:
        time.sleep(1)
    if left:
        say(f"jobs {', '.join(str(j.job_id) for j in left)} did not drain in time; cancelling")
        client.cancel([j.job_id for j in left])
        while ours() and time.monotonic() < deadline + 30:
            time.sleep(1)
