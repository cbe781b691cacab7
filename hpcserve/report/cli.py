"""`hpcserve report`: one sacct call, the period's usage records, the config's prices."""

from __future__ import annotations

import argparse
import calendar
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpcserve.config import PlatformConfig, config_path, load_config
from hpcserve.contracts.job_records import FILE_NAME as JOB_RECORDS
from hpcserve.contracts.job_records import JobRecord, read_job_records
from hpcserve.contracts.usage import ReadStats, read_records
from hpcserve.report.compute import PoolInfo, Prices, Report, build_report
from hpcserve.report.render import BY, as_csv, as_html, as_json, text
from hpcserve.slurm.client import SlurmCLI, SlurmError
from hpcserve.slurm.parse import AccountedJob, JobState

log = logging.getLogger(__name__)
_AGO = re.compile(r"^(\d+(?:\.\d+)?)([mhdw])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class WhenError(ValueError):
    pass


def parse_when(value: str, now: float) -> float:
    """`30d`, `12h`, `90m`, `2w` (that long before now), `now`, or a UTC date or time
    (`2026-11-01`, `2026-11-01T06:00`, `2026-11-01T06:00:00`)."""
    value = value.strip()
    if value == "now":
        return now
    match = _AGO.match(value)
    if match:
        return now - float(match.group(1)) * _UNIT_S[match.group(2)]
    for fmt in ("%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"):
        try:
            return float(calendar.timegm(time.strptime(value, fmt)))
        except ValueError:
            continue
    raise WhenError(
        f"{value!r} is not a time: use e.g. 30d, 12h, 90m, 2w, now, 2026-11-01 or "
        "2026-11-01T06:00 (UTC)"
    )


def accounting(
    config: PlatformConfig, since: float, until: float, client: SlurmCLI | None = None
) -> tuple[list[AccountedJob] | None, str]:
    """(jobs, where the GPU-hours come from): Slurm's accounting (sacct), else the pool
    manager's job records; jobs None when there is neither."""
    if config.poolmgr.launcher == "local":
        return None, "none: poolmgr.launcher is local (replicas are not Slurm jobs)"
    if client is None:
        env = dict(os.environ)
        if config.slurm.conf:
            env["SLURM_CONF"] = config.slurm.conf
        client = SlurmCLI(env, timeout_s=120)
    try:
        return client.accounting(since, until), "sacct"
    except SlurmError as err:
        said = err.stderr.strip().splitlines()[-1:] or [str(err)[:300]]
        sacct_error = f"sacct failed: {said[0]}"
    path = Path(config.state_dir) / JOB_RECORDS
    records = read_job_records(path)
    if not records:
        log.warning("no GPU-hours: %s; no pool manager job records in %s", sacct_error, path)
        return None, f"none: {sacct_error}; no job records in {path}"
    log.warning("GPU-hours from the pool manager's job records: %s", sacct_error)
    return [_accounted(r, until) for r in records], (
        f"the pool manager's job records ({path}), not Slurm's accounting ({sacct_error})"
    )


def _accounted(record: JobRecord, now: float) -> AccountedJob:
    end: float | None = record.end or None
    if end is None and record.time_limit_s and record.start + record.time_limit_s < now:
        end = record.start + record.time_limit_s  # its end was not seen: its limit at most
    return AccountedJob(
        job_id=record.job_id,
        name=record.name,
        partition=record.partition,
        state=JobState.parse(record.state),
        start=int(record.start),
        end=None if end is None else int(end),
        gpus=record.gpus,
        nodes=record.nodes,
    )


def make_report(
    config: PlatformConfig,
    since: float,
    until: float,
    *,
    client: SlurmCLI | None = None,
    usage_dir: str = "",
) -> Report:
    jobs, source = accounting(config, since, until, client)
    stats = ReadStats()
    records = list(read_records(Path(usage_dir or config.usage_dir()), since, until, stats))
    cost = config.cost
    report = build_report(
        since=since,
        until=until,
        jobs=jobs,
        usage=records,
        pools={p.name: PoolInfo(p.model, p.gpus_per_replica) for p in config.pools},
        job_prefix=config.poolmgr.job_name_prefix,
        prices=Prices(
            gpu_hour=cost.gpu_hour_price,
            per_partition=dict(cost.partition_gpu_hour_price),
            api_per_m_input=cost.api_price_per_m_input,
            api_per_m_output=cost.api_price_per_m_output,
            currency=cost.currency,
        ),
        gpu_hours_source=source,
        now=min(until, time.time()),
    )
    report.usage_files = stats.files
    report.usage_bad_lines = stats.bad_lines
    return report


def add_report_parser(
    sub: argparse._SubParsersAction,
    with_config: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
) -> None:
    p = with_config(
        sub.add_parser(
            "report",
            help="GPU-hours (sacct), tokens served and cost per pool, model and tenant",
        )
    )
    p.add_argument("--since", default="30d", help="start: 30d, 12h, 2026-11-01 ... (30d)")
    p.add_argument("--until", default="now", help="end: now (default) or a UTC date/time")
    p.add_argument("--by", choices=BY, default="pool", help="rows of the table (pool)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the whole report as JSON")
    out.add_argument("--csv", action="store_true", help="the --by rows as CSV")
    p.add_argument("--html", metavar="FILE", help="also write one static page with plots")
    p.add_argument("--usage-dir", default="", help="usage records (gateway.usage_dir)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    config = load_config(config_path(args.config))
    now = time.time()
    try:
        until = parse_when(args.until, now)
        since = parse_when(args.since, until if args.since[-1:] in _UNIT_S else now)
    except WhenError as err:
        print(f"hpcserve report: {err}", file=sys.stderr)
        return 2
    if since >= until:
        print("hpcserve report: --since must be before --until", file=sys.stderr)
        return 2
    report = make_report(config, since, until, usage_dir=args.usage_dir)
    if args.html:
        Path(args.html).write_text(as_html(report))
    if args.json:
        sys.stdout.write(as_json(report))
    elif args.csv:
        sys.stdout.write(as_csv(report, args.by))
    else:
        sys.stdout.write(text(report, args.by))
        if args.html:
            print(f"wrote {args.html}")
    return 0
