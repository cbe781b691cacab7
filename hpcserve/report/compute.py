"""What each pool, model and tenant used and cost over a period (pure: values in, report out).

GPU-hours: each of hpcserve's Slurm jobs (named `<job_name_prefix>-<pool>`) from Slurm's
accounting, its allocated GPUs (AllocTRES gres/gpu) times the part of its run that lies in
the period (a running job counts until `now`).

Tokens: the usage records (contracts/usage.py); a record names its replica, and the replica
id names its Slurm job (`<pool>-j<job>-<hex>`), so tokens land on the pool and the job that
served them. Records of replicas outside Slurm go to the pool that serves their model;
external-API (overflow) records are counted apart, in the pool row EXTERNAL alone (not in
the total, the models or the tenants): no GPU of ours served them.

Utilisation: the share of a job's GPU-time during which its replica had at least one
request in flight (the union of its records' [start, end] intervals). Idle GPU-hours are the
rest: loading, waiting for traffic, draining.

Cost: GPU-hours times the GPU-hour price of the job's partition. A pool's cost is split:
- between its models (a base model, its aliases' versions, LoRA adapters) and between its
  tenants (chargeback) by their share of its tokens (prompt + completion); a pool that
  served no token has its cost on its configured model and on the tenant UNUSED;
- between input and output tokens in the ratio of the API's prices (api_price_per_m_input
  / _output) when both are set, else a token is a token.
Break-even: the utilisation at which this GPU-time would have cost what the API charges for
the same tokens (current utilisation x own cost / API cost, tokens assumed to grow with
busy time); below it the API is cheaper, above it self-hosting is.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from hpcserve.contracts.usage import UsageRecord, replica_job
from hpcserve.planner.economics import break_even_utilisation
from hpcserve.slurm.parse import AccountedJob

UNUSED = "(unused)"  # the tenant of a pool's cost that no token of any tenant covers
EXTERNAL = "(external)"  # the pseudo-pool of requests the external API served
DAY_S = 86400


@dataclass(frozen=True)
class Prices:
    gpu_hour: float = 0.0  # 0: not set
    per_partition: Mapping[str, float] = field(default_factory=dict)
    api_per_m_input: float = 0.0
    api_per_m_output: float = 0.0
    currency: str = "USD"

    def of(self, partition: str) -> float:
        return self.per_partition.get(partition, self.gpu_hour)

    @property
    def priced(self) -> bool:
        return bool(self.gpu_hour or self.per_partition)

    @property
    def input_weight(self) -> float:
        """What an input token costs relative to an output token."""
        if self.api_per_m_input and self.api_per_m_output:
            return self.api_per_m_input / self.api_per_m_output
        return 1.0


@dataclass(frozen=True)
class PoolInfo:
    """What the config says of a pool."""

    model: str
    gpus_per_node: int  # pools[].gpus_per_replica: used when the accounting has no GPU count


class Row(msgspec.Struct, kw_only=True):
    """One line of the report: a pool, a model, a tenant, or the total."""

    name: str
    pool: str = ""  # a model's pool
    jobs: int = 0
    gpu_hours: float = 0.0  # a tenant's or model's: its share (chargeback)
    busy_gpu_hours: float = 0.0
    idle_gpu_hours: float = 0.0
    utilisation: float | None = None
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None
    cost_per_m_tokens: float | None = None
    cost_per_m_input: float | None = None
    cost_per_m_output: float | None = None
    api_cost: float | None = None
    break_even_utilisation: float | None = None


class DayRow(msgspec.Struct, kw_only=True):
    """One UTC day of one pool and model (the HTML page's plots)."""

    day: str
    pool: str
    model: str
    gpu_hours: float
    busy_gpu_hours: float
    tokens: int
    cost: float | None
    cost_per_m_tokens: float | None


class TenantDay(msgspec.Struct):
    day: str
    tenant: str
    tokens: int


class Report(msgspec.Struct, kw_only=True):
    since: float
    until: float
    currency: str
    gpu_hour_price: float
    partition_gpu_hour_price: dict[str, float]
    api_price_per_m_input: float
    api_price_per_m_output: float
    # Where the GPU-hours come from: "sacct" (Slurm's accounting), else why there are none.
    gpu_hours_source: str
    jobs_without_gpu_count: int  # their GPUs taken from the config (AccountingStorageTRES)
    total: Row
    pools: list[Row]
    models: list[Row]
    tenants: list[Row]
    days: list[DayRow]
    tenant_days: list[TenantDay]
    usage_files: int = 0
    usage_bad_lines: int = 0


# ------------------------------------------------------------------ intervals


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _day(epoch: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(epoch))


def _days(since: float, until: float) -> list[tuple[str, float, float]]:
    out = []
    start = since
    while start < until:
        end = min(until, (int(start) // DAY_S + 1) * DAY_S)
        out.append((_day(start), start, end))
        start = end
    return out


# ------------------------------------------------------------------ the figures


class _Acc:
    """Sums for one key (pool, or pool + model, or pool + tenant)."""

    __slots__ = ("busy_s", "completion", "gpu_s", "jobs", "prompt", "requests")

    def __init__(self) -> None:
        self.gpu_s = self.busy_s = 0.0
        self.jobs = self.requests = self.prompt = self.completion = 0

    def add_usage(self, record: UsageRecord) -> None:
        self.requests += 1
        self.prompt += record.prompt_tokens
        self.completion += record.completion_tokens

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion


def _costed(row: Row, cost: float | None, prices: Prices, utilisation: float | None) -> Row:
    """row with cost, cost per M tokens (all, input, output), API cost and break-even."""
    row.cost = cost
    if cost is None:
        return row
    tokens = row.prompt_tokens + row.completion_tokens
    if tokens:
        row.cost_per_m_tokens = cost / tokens * 1e6
        w = prices.input_weight
        weighted = w * row.prompt_tokens + row.completion_tokens
        if row.prompt_tokens:
            row.cost_per_m_input = cost * w / weighted * 1e6
        if row.completion_tokens:
            row.cost_per_m_output = cost / weighted * 1e6
    if prices.api_per_m_input or prices.api_per_m_output:
        api = (
            row.prompt_tokens * prices.api_per_m_input
            + row.completion_tokens * prices.api_per_m_output
        ) / 1e6
        row.api_cost = api
        if api > 0 and utilisation:
            # the planner's: own cost at full use (this GPU-time, were it always busy) / API
            row.break_even_utilisation = break_even_utilisation(utilisation * cost, api)
    return row


def build_report(
    *,
    since: float,
    until: float,
    jobs: Iterable[AccountedJob] | None,
    usage: Iterable[UsageRecord],
    pools: Mapping[str, PoolInfo],
    job_prefix: str,
    prices: Prices,
    gpu_hours_source: str = "sacct",
    now: float | None = None,
) -> Report:
    """jobs: Slurm's accounting of the period (None: unavailable, see gpu_hours_source);
    job_prefix: poolmgr.job_name_prefix (its jobs are named `<prefix>-<pool>`)."""
    now = until if now is None else now
    model_pool = {info.model: name for name, info in pools.items()}
    days = _days(since, until)

    # The jobs: pool, GPUs, price, the part of their run in the period.
    job_pool: dict[int, str] = {}
    job_span: dict[int, tuple[float, float, int, float]] = {}  # start, end, gpus, price
    no_gpu_count = 0
    for job in jobs or ():
        if not job.name.startswith(job_prefix + "-") or job.start is None:
            continue
        pool = job.name[len(job_prefix) + 1 :]
        start, end = float(job.start), float(job.end if job.end is not None else now)
        if _overlap(start, end, since, until) <= 0:
            continue
        gpus = job.gpus
        if gpus is None:
            no_gpu_count += 1
            gpus = (pools[pool].gpus_per_node if pool in pools else 0) * max(job.nodes, 1)
        job_pool[job.job_id] = pool
        job_span[job.job_id] = (start, end, gpus, prices.of(job.partition))

    # The records: by pool, model, tenant; each replica's busy intervals.
    by_pool: dict[str, _Acc] = defaultdict(_Acc)
    by_model: dict[tuple[str, str], _Acc] = defaultdict(_Acc)
    by_tenant: dict[tuple[str, str], _Acc] = defaultdict(_Acc)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    tokens_day: dict[tuple[str, str, str], int] = defaultdict(int)  # day, pool, model
    tenant_day: dict[tuple[str, str], int] = defaultdict(int)
    for record in usage:
        job_id = None
        if record.external:
            pool = EXTERNAL
        else:
            located = replica_job(record.replica)
            if located is not None:
                pool, job_id = located
                pool = job_pool.get(job_id, pool)
            else:
                pool = model_pool.get(record.served or record.model, "") or model_pool.get(
                    record.model, "(unknown)"
                )
        by_pool[pool].add_usage(record)
        if pool == EXTERNAL:  # its own row; models and tenants are what our GPUs served
            continue
        by_model[(pool, record.model)].add_usage(record)
        by_tenant[(pool, record.tenant)].add_usage(record)
        tokens = record.prompt_tokens + record.completion_tokens
        tokens_day[(_day(record.end), pool, record.model)] += tokens
        tenant_day[(_day(record.end), record.tenant)] += tokens
        if job_id is not None and job_id in job_span:
            busy[job_id].append((record.start, record.end))

    # GPU-seconds, busy GPU-seconds and cost per pool, and per pool and day.
    pool_cost: dict[str, float] = defaultdict(float)
    day_gpu: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for job_id, (start, end, gpus, price) in job_span.items():
        pool = job_pool[job_id]
        acc = by_pool[pool]
        acc.jobs += 1
        intervals = _union(
            [(max(s, start), min(e, end)) for s, e in busy.get(job_id, []) if e > start]
        )
        for day, d0, d1 in days:
            gpu_s = _overlap(start, end, d0, d1) * gpus
            if not gpu_s:
                continue
            busy_s = sum(_overlap(s, e, d0, d1) for s, e in intervals) * gpus
            acc.gpu_s += gpu_s
            acc.busy_s += busy_s
            pool_cost[pool] += gpu_s / 3600 * price
            sums = day_gpu[(day, pool)]
            sums[0] += gpu_s
            sums[1] += busy_s
            sums[2] += gpu_s / 3600 * price

    have_gpus = jobs is not None
    priced = have_gpus and prices.priced

    def row(name: str, acc: _Acc) -> Row:
        return Row(
            name=name,
            jobs=acc.jobs,
            gpu_hours=acc.gpu_s / 3600,
            busy_gpu_hours=acc.busy_s / 3600,
            idle_gpu_hours=(acc.gpu_s - acc.busy_s) / 3600,
            requests=acc.requests,
            prompt_tokens=acc.prompt,
            completion_tokens=acc.completion,
        )

    pool_rows = []
    total = _Acc()
    for name in sorted(by_pool):
        acc = by_pool[name]
        utilisation = acc.busy_s / acc.gpu_s if acc.gpu_s else None
        r = row(name, acc)
        r.utilisation = utilisation
        cost = pool_cost[name] if priced and name != EXTERNAL else None
        pool_rows.append(_costed(r, cost, prices, utilisation))
        if name == EXTERNAL:
            continue
        for attr in ("gpu_s", "busy_s", "jobs", "requests", "prompt", "completion"):
            setattr(total, attr, getattr(total, attr) + getattr(acc, attr))
    total_cost = sum(pool_cost.values()) if priced else None
    total_row = row("total", total)
    total_row.utilisation = total.busy_s / total.gpu_s if total.gpu_s else None
    _costed(total_row, total_cost, prices, total_row.utilisation)

    def shared(groups: dict[tuple[str, str], _Acc], idle_name: str | None) -> list[Row]:
        """Rows of (pool, key) groups, each with its token share of the pool's GPU-hours
        and cost; a pool without tokens goes to idle_name (or its configured model)."""
        merged: dict[str, Row] = {}
        parts: dict[str, list[tuple[Row, float, str]]] = defaultdict(list)
        for (pool, key), acc in groups.items():
            pool_acc = by_pool[pool]
            share = (
                acc.tokens / pool_acc.tokens
                if pool_acc.tokens
                else 1.0 / len([k for k in groups if k[0] == pool])
            )
            parts[key].append((row(key, acc), share, pool))
        for pool, acc in by_pool.items():
            if acc.gpu_s and not acc.tokens and not any(k[0] == pool for k in groups):
                key = idle_name or (pools[pool].model if pool in pools else pool)
                parts[key].append((row(key, _Acc()), 1.0, pool))
        for key, items in parts.items():
            out = Row(name=key)
            cost: float | None = 0.0 if priced else None
            pools_of = sorted({pool for _, _, pool in items})
            out.pool = ",".join(pools_of)
            for r, share, pool in items:
                pool_acc = by_pool[pool]
                out.gpu_hours += pool_acc.gpu_s / 3600 * share
                out.busy_gpu_hours += pool_acc.busy_s / 3600 * share
                out.idle_gpu_hours += (pool_acc.gpu_s - pool_acc.busy_s) / 3600 * share
                out.requests += r.requests
                out.prompt_tokens += r.prompt_tokens
                out.completion_tokens += r.completion_tokens
                if cost is not None and pool != EXTERNAL:
                    cost += pool_cost[pool] * share
            out.utilisation = out.busy_gpu_hours / out.gpu_hours if out.gpu_hours else None
            merged[key] = _costed(out, cost, prices, out.utilisation)
        return [merged[k] for k in sorted(merged)]

    models = shared(by_model, None)
    tenants = shared(by_tenant, UNUSED)

    day_rows = []
    for (day, pool), (gpu_s, busy_s, cost) in sorted(day_gpu.items()):
        pool_tokens = {m: t for (d, p, m), t in tokens_day.items() if d == day and p == pool}
        all_tokens = sum(pool_tokens.values())
        if not pool_tokens:
            pool_tokens = {pools[pool].model if pool in pools else pool: 0}
        for model, tokens in sorted(pool_tokens.items()):
            share = tokens / all_tokens if all_tokens else 1.0
            model_cost = cost * share if priced else None
            day_rows.append(
                DayRow(
                    day=day,
                    pool=pool,
                    model=model,
                    gpu_hours=gpu_s / 3600 * share,
                    busy_gpu_hours=busy_s / 3600 * share,
                    tokens=tokens,
                    cost=model_cost,
                    cost_per_m_tokens=model_cost / tokens * 1e6
                    if model_cost is not None and tokens
                    else None,
                )
            )
    return Report(
        since=since,
        until=until,
        currency=prices.currency,
        gpu_hour_price=prices.gpu_hour,
        partition_gpu_hour_price=dict(prices.per_partition),
        api_price_per_m_input=prices.api_per_m_input,
        api_price_per_m_output=prices.api_per_m_output,
        gpu_hours_source=gpu_hours_source,
        jobs_without_gpu_count=no_gpu_count,
        total=total_row,
        pools=pool_rows,
        models=models,
        tenants=tenants,
        days=day_rows,
        tenant_days=[TenantDay(d, t, n) for (d, t), n in sorted(tenant_day.items())],
    )
