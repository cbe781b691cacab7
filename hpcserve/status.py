"""`hpcserve status`: pools, their Slurm jobs and live replicas, as a table or JSON."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from hpcserve.config import PlatformConfig, PoolConfig
from hpcserve.contracts.router_client import RouterQueryError, list_replicas
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.poolmgr.rollout import Rollout
from hpcserve.poolmgr.rollout_state import RolloutBook, RolloutStateError
from hpcserve.poolmgr.state_files import PoolStatus, read_status


def collect_jobs(config: PlatformConfig) -> list[dict[str, Any]]:
    from hpcserve.poolmgr.launchers import make_launcher

    snapshot = make_launcher(config).jobs(name_prefix=config.poolmgr.job_name_prefix + "-")
    jobs = []
    for job in snapshot.jobs:
        identity = parse_comment(job.comment)
        if identity is None or not job.state.is_active:
            continue
        jobs.append(
            {
                "job_id": job.job_id,
                "pool": identity.pool,
                "state": job.state.value,
                "node": ",".join(job.nodes),
                "reason": job.state_reason,
                "started": job.start_time,
                "time_limit_s": job.time_limit_s,
                "time_left": _time_left(job.start_time, job.time_limit_s, job.state.value),
            }
        )
    return jobs


def _time_left(start: int | None, limit_s: int | None, state: str) -> str:
    """Until the job's time limit, as "3h05m" (running jobs with a limit only)."""
    if state != "RUNNING" or not start or not limit_s:
        return ""
    left = max(int(start + limit_s - time.time()), 0)
    return f"{left // 3600}h{left % 3600 // 60:02d}m"


def collect_nodes(config: PlatformConfig) -> list[dict[str, Any]]:
    from hpcserve.poolmgr.launchers import make_launcher

    return [
        {
            "node": node.name,
            "state": "+".join(node.state),
            "gpus": node.gres,
            "gpus_used": node.gres_used,
            "reason": node.reason,
        }
        for node in make_launcher(config).nodes()
    ]


def collect_rollouts(config: PlatformConfig) -> list[dict[str, Any]]:
    """The staged rollouts in progress (pending, holding, paused) from the rollout state file
    (poolmgr/rollout_state.py); finished ones are `hpcserve rollout status`'s."""
    return [
        rollout_row(r)
        for _alias, r in sorted(RolloutBook(Path(config.state_dir)).read().items())
        if r.active
    ]


def rollout_row(r: Rollout) -> dict[str, Any]:
    """One rollout's line: where it stands and the last check's verdict."""
    return {
        "alias": r.alias,
        "version": r.ref,
        "stable": r.stable,
        "state": r.state,
        "step": f"{r.step + 1}/{len(r.steps)}" if r.step >= 0 else f"-/{len(r.steps)}",
        "share": f"{r.share}%",
        "steps": ",".join(map(str, r.steps)),
        "every_s": r.every_s,
        "step_since": r.step_since,
        "forced": r.forced,
        "note": r.note or r.reason,
    }


def collect_status(config: PlatformConfig) -> dict[str, Any]:
    status: dict[str, Any] = {"pools": [], "jobs": [], "replicas": [], "nodes": [], "errors": []}
    status["rollouts"] = []
    try:
        status["rollouts"] = collect_rollouts(config)
    except (RolloutStateError, OSError) as err:
        status["errors"].append(f"rollouts: {err}")
    try:
        status["jobs"] = collect_jobs(config)
        status["nodes"] = collect_nodes(config)
    except Exception as err:  # report it; a status command must not crash on a Slurm hiccup
        status["errors"].append(f"slurm: {err}")
    try:
        replicas = list_replicas(config.router.gateways_dial(), curve_dir=config.router.curve_dir)
        status["replicas"] = [
            {
                "replica_id": r.replica_id,
                "model": r.model,
                "pool": r.pool,
                "url": r.url,
                "job_id": r.slurm_job_id,
                "node": r.node,
                "switch": r.switch,  # its node's leaf switch ("": no topology/tree)
                "in_flight": r.in_flight,
                "running": r.load.running,
                "waiting": r.load.waiting,
                "age_s": round(r.age_s),
            }
            for r in replicas
        ]
    except RouterQueryError as err:
        status["errors"].append(f"router: {err}")
    report = read_status(Path(config.state_dir))
    reported = {p.pool: p for p in report.pools} if report else {}
    if report is None:
        status["errors"].append("pool manager: no status report yet (is it running?)")
    for pool in config.pools:
        status["pools"].append(
            pool_row(pool, status["jobs"], status["replicas"], reported.get(pool.name))
        )
    return status


def pool_row(
    pool: PoolConfig,
    jobs: list[dict[str, Any]],
    replicas: list[dict[str, Any]],
    reported: PoolStatus | None,
) -> dict[str, Any]:
    """One pool's line: the config, what Slurm and the router show, the pool manager's report."""
    row: dict[str, Any] = {
        "pool": pool.name,
        "model": pool.model,
        "role": pool.role,
        "desired": pool.replicas,
        "jobs": sum(1 for j in jobs if j["pool"] == pool.name),
        "serving": sum(1 for r in replicas if r["pool"] == pool.name),
    }
    if reported is not None:
        seen = msgspec.structs.asdict(reported)
        row |= {
            k: seen[k]
            for k in (
                "desired",
                "admin",
                "draining",
                "retiring",
                "failures",
                "last_failure",
                "next_submit_in_s",
                "pending",
                "backlog",
                "cold_start",
            )
        }
    if reported is not None and reported.autoscale is not None:
        auto = reported.autoscale
        row["autoscale"] = f"{auto.min}..{auto.max}, target {auto.target}"
        row["autoscale_detail"] = msgspec.structs.asdict(auto)
    if pool.max_replicas:
        backlog = row.get("backlog")
        row["elastic"] = f"{pool.replicas}..{pool.max_replicas}" + (
            f", backlog {backlog}" if backlog is not None else ""
        )
    return row


def _table(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    cells = [
        [str(row.get(c, "")) if row.get(c) is not None else "-" for c in columns] for row in rows
    ]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return lines


def format_status(status: dict[str, Any]) -> str:
    elastic = ["elastic"] if any("elastic" in row for row in status["pools"]) else []
    scaled = ["autoscale"] if any("autoscale" in row for row in status["pools"]) else []
    lines = _table(
        status["pools"],
        ["pool", "model", "role", "desired", "jobs", "serving", "admin", *elastic, *scaled,
         "failures", "last_failure"],
    )  # fmt: skip
    for row in status["pools"]:
        if "autoscale_detail" in row:
            auto = row["autoscale_detail"]
            lines += [
                f"  {row['pool']}: {auto['signals']}",
                f"    last change: {auto['last_reason'] or '-'}",
                f"    now: {auto['now']}",
            ]
            if auto.get("capacity"):
                lines.append(f"    capacity: {auto['capacity']}")
        if row.get("cold_start"):
            lines.append(f"  {row['pool']}: cold start {row['cold_start']}")
    if status["jobs"]:
        lines += [
            "",
            *_table(status["jobs"], ["job_id", "pool", "state", "node", "time_left", "reason"]),
        ]
    if status["replicas"]:
        lines += [
            "",
            *_table(
                status["replicas"],
                [
                    "replica_id",
                    "model",
                    "job_id",
                    "node",
                    "url",
                    "age_s",
                    "in_flight",
                    "running",
                    "waiting",
                ],
            ),
        ]
    if status["nodes"]:
        lines += ["", *_table(status["nodes"], ["node", "state", "gpus", "gpus_used", "reason"])]
    if status.get("rollouts"):
        lines += [
            "",
            *_table(
                status["rollouts"], ["alias", "version", "stable", "state", "step", "share", "note"]
            ),
        ]
    lines += [f"error: {e}" for e in status["errors"]]
    return "\n".join(lines)
