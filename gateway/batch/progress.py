"""`hpcserve batches`: batches with their counts, tokens/s and ETA, read from the store."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from hpcserve.gateway.batch.store import ACTIVE, BatchRecord, BatchStore


class Progress(msgspec.Struct, frozen=True):
    done: int
    tokens_per_s: float | None
    eta_s: float | None


def progress_of(batch: BatchRecord, now: float) -> Progress:
    """Tokens/s since the batch started running (until it ended), and, while it runs, the
    time left at the request rate so far."""
    done = batch.completed + batch.failed
    start = batch.in_progress_at
    if start is None:
        return Progress(done, None, None)
    end = next(
        (
            t
            for t in (batch.completed_at, batch.expired_at, batch.cancelled_at, batch.failed_at)
            if t is not None
        ),
        None,
    )
    elapsed = max((end if end is not None else now) - start, 1e-9)
    tokens_per_s = (batch.input_tokens + batch.output_tokens) / elapsed
    eta = None
    if batch.status in ACTIVE and done:
        eta = (batch.total - done) * elapsed / done
    return Progress(done, tokens_per_s, eta)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def format_batches(batches: list[BatchRecord], now: float) -> str:
    header = ("BATCH", "TENANT", "STATUS", "DONE", "FAILED", "TOTAL", "TOKENS/S", "ETA", "AGE")
    rows = [header]
    for batch in batches:
        progress = progress_of(batch, now)
        rows.append(
            (
                batch.id,
                batch.tenant,
                batch.status,
                str(batch.completed),
                str(batch.failed),
                str(batch.total),
                "-" if progress.tokens_per_s is None else f"{progress.tokens_per_s:,.0f}",
                _duration(progress.eta_s),
                _duration(now - batch.created_at),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def list_recent(root: Path, *, limit: int, tenant: str | None) -> list[BatchRecord]:
    if not (root / "batch.sqlite3").exists():
        return []
    store = BatchStore(root)
    try:
        return store.list_batches(tenant, limit=limit).items
    finally:
        store.close()


def add_batches_parser(
    sub: argparse._SubParsersAction,
    with_config: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
) -> None:
    p = with_config(sub.add_parser("batches", help="Batch API batches: counts, tokens/s, ETA"))
    p.add_argument("--tenant", default=None, help="only this tenant's batches")
    p.add_argument("--limit", type=int, default=20, help="newest N batches (default 20)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_batches)


def cmd_batches(args: argparse.Namespace) -> int:
    from hpcserve.config import config_path, load_config

    config = load_config(config_path(args.config))
    batches = list_recent(Path(config.batch_dir()), limit=args.limit, tenant=args.tenant)
    now = time.time()
    if args.json:
        out = []
        for batch in batches:
            progress = progress_of(batch, now)
            out.append(
                {
                    **msgspec.to_builtins(batch),
                    "tokens_per_s": progress.tokens_per_s,
                    "eta_s": progress.eta_s,
                }
            )
        print(json.dumps(out, indent=2))
    elif not batches:
        print(f"no batches in {config.batch_dir()}")
    else:
        print(format_batches(batches, now))
        print(runner_line(Path(config.batch_dir())))
    return 0


def runner_line(root: Path) -> str:
    """Who runs the batches now (the runner lock's holder, gateway/batch/lock.py)."""
    from hpcserve.gateway.batch.lock import RunnerLock

    holder = RunnerLock(root, "never", name="hpcserve batches").holder()
    return f"runner: {holder}" if holder else "runner: none (no process holds runner.lock)"
