"""The pool manager's own record of its jobs (poolmgr/job_records.py writes it): where Slurm
keeps no accounting (no slurmdbd) or replicas are local processes (`--launcher local`),
`hpcserve report` takes GPU-hours from here instead of sacct, and says so.

`<state_dir>/job-records.jsonl`, one JSON line per event: a job seen running (its start, GPUs,
partition, time limit), and the job ended (its end). A job's last line wins. An end the pool
manager never saw (it was down when the job ended, and squeue had forgotten the job when it
came back) is bounded by the job's time limit: Slurm ends a job there at the latest.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

FILE_NAME = "job-records.jsonl"


class JobRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    job_id: int
    name: str  # the Slurm job name, <poolmgr.job_name_prefix>-<pool>
    pool: str
    partition: str
    gpus: int  # all nodes'
    nodes: int
    start: float
    end: float = 0.0  # 0: running when written
    time_limit_s: float = 0.0  # 0: none known
    state: str = ""


_decode = msgspec.json.Decoder(JobRecord).decode
_encode = msgspec.json.Encoder().encode


def encode(record: JobRecord) -> bytes:
    return _encode(record) + b"\n"


def read_job_records(path: Path) -> list[JobRecord]:
    """Each job's last record (lines that do not decode, a torn last one, are skipped)."""
    last: dict[tuple[int, float], JobRecord] = {}  # by id and start: a reused id is new
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return []
    with f:
        for line in f:
            try:
                record = _decode(line)
            except msgspec.DecodeError:
                continue
            last[(record.job_id, record.start)] = record
    return list(last.values())


__all__ = ["FILE_NAME", "JobRecord", "encode", "read_job_records"]
