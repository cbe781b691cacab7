"""`hpcserve report`'s figures (hpcserve/report/compute.py) on a worked example, its outputs
and its command line (a fake sacct, real usage files)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path

import pytest

from hpcserve.config import parse_config
from hpcserve.contracts.usage import UsageRecord
from hpcserve.gateway.usage_log import UsageLog
from hpcserve.report.cli import WhenError, make_report, parse_when
from hpcserve.report.compute import EXTERNAL, UNUSED, PoolInfo, Prices, Report, build_report
from hpcserve.report.render import as_csv, as_html, as_json, text
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import AccountedJob, JobState

H, DAY = 3600.0, 86400.0
T0 = 1_780_012_800.0  # 2026-05-29T00:00:00Z
PRICES = Prices(gpu_hour=2.0, per_partition={"a100": 4.0}, api_per_m_input=1.0, api_per_m_output=4.0)  # fmt: skip
POOLS = {"chat": PoolInfo("chat", 1), "embed": PoolInfo("embed", 4)}


def _job(job_id: int, name: str, start: float | None, end: float | None, gpus: int | None, partition: str = "gpu") -> AccountedJob:  # fmt: skip
    state = JobState.RUNNING if end is None else JobState.COMPLETED
    to_int = lambda t: None if t is None else int(t)  # noqa: E731
    return AccountedJob(job_id, name, partition, state, to_int(start), to_int(end), gpus, 1)


JOBS = [
    _job(1, "hpcserve-chat", T0 - H, T0 + H, 2),  # 1 h of it in the period, 2 GPUs
    _job(2, "hpcserve-chat", T0 + DAY, None, 1, "a100"),  # running: until `now`
    _job(3, "hpcserve-embed", T0, T0 + H / 2, None),  # no gres/gpu TRES: the config's 4
    _job(4, "train", T0, T0 + DAY, 8),  # not ours
    _job(5, "hpcserve-chat", None, None, 1),  # never started
]


def _use(replica: str, tenant: str, model: str, start: float, end: float, tokens: tuple[int, int], external: bool = False) -> UsageRecord:  # fmt: skip
    return UsageRecord(
        start=start,
        end=end,
        tenant=tenant,
        model=model,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        status=200,
        replica=replica,
        external=external,
    )


USAGE = [
    _use("chat-j1-aaaaaa", "a", "chat", T0, T0 + 600, (1000, 500)),
    _use("chat-j1-aaaaaa", "b", "chat", T0 + 300, T0 + 900, (200, 300)),  # overlaps: 900 s busy
    _use("chat-j2-bbbbbb", "a", "chat-lora", T0 + DAY, T0 + DAY + 1800, (800, 200)),
    _use("", "b", "chat", T0 + 5, T0 + 6, (100, 100), external=True),
]


@pytest.fixture
def report() -> Report:
    return build_report(
        since=T0,
        until=T0 + 2 * DAY,
        jobs=JOBS,
        usage=USAGE,
        pools=POOLS,
        job_prefix="hpcserve",
        prices=PRICES,
        now=T0 + DAY + 2 * H,
    )


def _rows(rows: list) -> dict[str, object]:
    return {r.name: r for r in rows}


def test_pools_gpu_hours_utilisation_and_cost(report: Report) -> None:
    pools = _rows(report.pools)
    assert sorted(pools) == [EXTERNAL, "chat", "embed"]
    chat = pools["chat"]
    # job 1: 1 h x 2 GPUs at 2.0; job 2: 2 h x 1 GPU at the a100 price 4.0
    assert (chat.jobs, chat.gpu_hours, chat.cost) == (2, pytest.approx(4.0), pytest.approx(12.0))
    # busy: 900 s of job 1 (x2 GPUs) and 1800 s of job 2 (x1): 1 GPU-hour of 4
    assert chat.busy_gpu_hours == pytest.approx(1.0)
    assert chat.idle_gpu_hours == pytest.approx(3.0)
    assert chat.utilisation == pytest.approx(0.25)
    assert (chat.requests, chat.prompt_tokens, chat.completion_tokens) == (3, 2000, 1000)
    assert chat.cost_per_m_tokens == pytest.approx(12.0 / 3000 * 1e6)
    # split by the API's price ratio (1 : 4): 2000 in cost 4.0, 1000 out cost 8.0
    assert chat.cost_per_m_input == pytest.approx(2000.0)
    assert chat.cost_per_m_output == pytest.approx(8000.0)
    assert chat.api_cost == pytest.approx(0.006)
    assert chat.break_even_utilisation == pytest.approx(0.25 * 12.0 / 0.006)
    embed = pools["embed"]
    assert (embed.gpu_hours, embed.utilisation, embed.cost) == (
        pytest.approx(2.0),
        pytest.approx(0.0),
        pytest.approx(4.0),
    )
    assert embed.cost_per_m_tokens is None and embed.break_even_utilisation is None
    assert report.jobs_without_gpu_count == 1
    external = pools[EXTERNAL]
    assert (external.requests, external.gpu_hours, external.cost) == (1, 0.0, None)


def test_the_total_is_our_gpus_alone(report: Report) -> None:
    total = report.total
    assert (total.gpu_hours, total.busy_gpu_hours, total.cost) == (
        pytest.approx(6.0),
        pytest.approx(1.0),
        pytest.approx(16.0),
    )
    assert (total.requests, total.prompt_tokens, total.completion_tokens) == (3, 2000, 1000)


def test_models_share_their_pools_cost_by_tokens(report: Report) -> None:
    models = _rows(report.models)
    assert sorted(models) == ["chat", "chat-lora", "embed"]
    assert models["chat"].cost == pytest.approx(12.0 * 2 / 3)
    assert models["chat"].gpu_hours == pytest.approx(4.0 * 2 / 3)
    assert models["chat-lora"].cost == pytest.approx(4.0)
    assert models["embed"].cost == pytest.approx(4.0)  # no token: all on its model
    assert models["embed"].requests == 0
    assert sum(m.cost for m in models.values()) == pytest.approx(report.total.cost)


def test_tenants_are_charged_their_token_share(report: Report) -> None:
    tenants = _rows(report.tenants)
    assert sorted(tenants) == [UNUSED, "a", "b"]
    assert tenants["a"].cost == pytest.approx(12.0 * 2500 / 3000)
    assert tenants["b"].cost == pytest.approx(12.0 * 500 / 3000)
    assert tenants["b"].prompt_tokens == 200  # its overflow request is not our GPUs' work
    assert tenants[UNUSED].cost == pytest.approx(4.0)
    assert tenants[UNUSED].gpu_hours == pytest.approx(2.0)
    assert sum(t.cost for t in tenants.values()) == pytest.approx(report.total.cost)
    assert sum(t.gpu_hours for t in tenants.values()) == pytest.approx(report.total.gpu_hours)


def test_days(report: Report) -> None:
    days = {(d.day, d.pool, d.model): d for d in report.days}
    assert sorted(days) == [
        ("2026-05-29", "chat", "chat"),
        ("2026-05-29", "embed", "embed"),
        ("2026-05-30", "chat", "chat-lora"),
    ]
    lora = days[("2026-05-30", "chat", "chat-lora")]
    assert (lora.gpu_hours, lora.cost, lora.tokens) == (
        pytest.approx(2.0),
        pytest.approx(8.0),
        1000,
    )
    assert lora.cost_per_m_tokens == pytest.approx(8000.0)
    assert [(t.day, t.tenant, t.tokens) for t in report.tenant_days] == [
        ("2026-05-29", "a", 1500),
        ("2026-05-29", "b", 500),
        ("2026-05-30", "a", 1000),
    ]


def test_without_a_price_or_accounting_there_is_no_cost() -> None:
    unpriced = build_report(
        since=T0, until=T0 + DAY, jobs=JOBS, usage=USAGE, pools=POOLS, job_prefix="hpcserve",
        prices=Prices(), now=T0 + DAY,
    )  # fmt: skip
    assert unpriced.total.gpu_hours > 0 and unpriced.total.cost is None
    blind = build_report(
        since=T0, until=T0 + DAY, jobs=None, usage=USAGE, pools=POOLS, job_prefix="hpcserve",
        prices=PRICES, gpu_hours_source="none: no slurmdbd", now=T0 + DAY,
    )  # fmt: skip
    assert blind.total.cost is None and blind.total.gpu_hours == 0
    assert blind.total.prompt_tokens == 2000  # the tokens still count
    assert "none: no slurmdbd" in text(blind, "pool")


def test_outputs(report: Report, tmp_path: Path) -> None:
    table = text(report, "tenant")
    assert "GPU-hours from: sacct" in table and UNUSED in table and "total" in table
    decoded = json.loads(as_json(report))
    assert decoded["total"]["cost"] == pytest.approx(16.0)
    rows = list(csv.DictReader(io.StringIO(as_csv(report, "model"))))
    assert [r["name"] for r in rows] == ["chat", "chat-lora", "embed", "total"]
    page = as_html(report)
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 3
    assert "<script" not in page and "http" not in page.split("<body>")[1]  # self-contained


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("30d", T0 - 30 * DAY),
        ("12h", T0 - 12 * H),
        ("90m", T0 - 5400),
        ("2w", T0 - 14 * DAY),
        ("now", T0),
        ("2026-05-01", 1_777_593_600.0),
        ("2026-05-01T06:00", 1_777_593_600.0 + 6 * H),
    ],
)
def test_parse_when(value: str, expected: float) -> None:
    assert parse_when(value, T0) == expected


def test_parse_when_rejects() -> None:
    with pytest.raises(WhenError, match="'last month' is not a time"):
        parse_when("last month", T0)


class _Sacct:
    def __call__(self, argv: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        assert argv[0] == "sacct"
        out = f"11|gpu|COMPLETED|{int(T0)}|{int(T0 + H)}|cpu=1,gres/gpu=1|1|hpcserve-chat\n"
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_make_report_reads_sacct_and_the_usage_files(tmp_path: Path) -> None:
    config = parse_config(
        {
            "state_dir": str(tmp_path),
            "cost": {"gpu_hour_price": 3.0},
            "pools": [{"name": "chat", "served_model_name": "chat", "model_path": "/m"}],
        }
    )
    usage = UsageLog(config.usage_dir(), "gateway")
    usage.write(_use("chat-j11-cccccc", "a", "chat", T0 + 10, T0 + 20, (60, 40)))
    usage.close()
    report = make_report(config, T0, T0 + DAY, client=SlurmCLI({}, runner=_Sacct()))
    (chat,) = report.pools
    assert (chat.gpu_hours, chat.cost, chat.prompt_tokens + chat.completion_tokens) == (
        pytest.approx(1.0),
        pytest.approx(3.0),
        100,
    )
    assert chat.cost_per_m_tokens == pytest.approx(3.0 / 100 * 1e6)
    assert report.usage_files == 1
