"""The report as a text table, CSV, JSON, or one static HTML page with its plots inline
(SVG drawn here: no script, no file or network fetch, so it can be mailed or archived)."""

from __future__ import annotations

import csv
import html
import io
import time
from collections import defaultdict
from collections.abc import Callable

import msgspec

from hpcserve.report.compute import Report, Row

BY = ("pool", "model", "tenant")
_CSV_FIELDS = list(Row.__struct_fields__)


def rows_by(report: Report, by: str) -> list[Row]:
    return {"pool": report.pools, "model": report.models, "tenant": report.tenants}[by]


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _cost(value: float | None) -> str:
    """Money: cents, or 4 significant digits below 1 (a test's or a quiet day's cost)."""
    if value is None:
        return "-"
    return f"{value:,.2f}" if abs(value) >= 1 or value == 0 else f"{value:.4g}"


def _break_even(value: float | None) -> str:
    """Above 100% the GPUs would have to be busier than always: the API stays cheaper."""
    if value is None:
        return "-"
    return f"{value * 100:.1f}%" if value <= 1 else "never"


def header_lines(report: Report) -> list[str]:
    lines = [
        f"period: {_when(report.since)} to {_when(report.until)}",
        f"GPU-hours from: {report.gpu_hours_source}",
    ]
    if report.gpu_hour_price or report.partition_gpu_hour_price:
        parts = [f"{report.gpu_hour_price:g} {report.currency}/GPU-hour"]
        parts += [f"{k}: {v:g}" for k, v in sorted(report.partition_gpu_hour_price.items())]
        lines.append("price: " + ", ".join(parts))
    else:
        lines.append("price: not set (cost.gpu_hour_price): no cost figures")
    if report.api_price_per_m_input or report.api_price_per_m_output:
        lines.append(
            f"API price per M tokens: {report.api_price_per_m_input:g} in, "
            f"{report.api_price_per_m_output:g} out ({report.currency})"
        )
    if report.jobs_without_gpu_count:
        lines.append(
            f"note: {report.jobs_without_gpu_count} job(s) without gres/gpu in their AllocTRES "
            "(AccountingStorageTRES): their GPUs are the pool's configured count"
        )
    if report.usage_bad_lines:
        lines.append(f"note: {report.usage_bad_lines} unreadable usage line(s) skipped")
    return lines


_COLUMNS: tuple[tuple[str, Callable[[Row, str], str]], ...] = (
    ("GPU-h", lambda r, c: _num(r.gpu_hours)),
    ("idle GPU-h", lambda r, c: _num(r.idle_gpu_hours)),
    ("util", lambda r, c: _pct(r.utilisation)),
    ("requests", lambda r, c: f"{r.requests:,}"),
    ("tokens in", lambda r, c: f"{r.prompt_tokens:,}"),
    ("tokens out", lambda r, c: f"{r.completion_tokens:,}"),
    ("cost", lambda r, c: _cost(r.cost)),
    ("/M tokens", lambda r, c: _cost(r.cost_per_m_tokens)),
    ("/M in", lambda r, c: _cost(r.cost_per_m_input)),
    ("/M out", lambda r, c: _cost(r.cost_per_m_output)),
    ("API cost", lambda r, c: _cost(r.api_cost)),
    ("break-even", lambda r, c: _break_even(r.break_even_utilisation)),
)


def text(report: Report, by: str) -> str:
    rows = [*rows_by(report, by), report.total]
    table = [[by, *(name for name, _ in _COLUMNS)]]
    for r in rows:
        table.append([r.name, *(cell(r, report.currency) for _, cell in _COLUMNS)])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    out = [*header_lines(report), ""]
    for n, line in enumerate(table):
        if n == len(table) - 1:
            out.append("  ".join("-" * w for w in widths))
        out.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    if report.total.cost is not None:
        out.append(f"(money in {report.currency})")
    return "\n".join(out) + "\n"


def as_json(report: Report) -> str:
    return msgspec.json.format(msgspec.json.encode(report).decode(), indent=2) + "\n"


def as_csv(report: Report, by: str) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["by", *_CSV_FIELDS])
    for r in [*rows_by(report, by), report.total]:
        writer.writerow([by, *("" if v is None else v for v in msgspec.structs.astuple(r))])
    return buf.getvalue()


# ------------------------------------------------------------------ HTML

_PALETTE = ("#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5")


def _svg_lines(
    title: str, series: dict[str, list[tuple[str, float]]], unit: str, percent: bool = False
) -> str:
    """A line chart (days on x) of named series, as inline SVG; empty data says so."""
    esc = html.escape
    points = [v for s in series.values() for _, v in s]
    if not points:
        return f"<figure><figcaption>{esc(title)}</figcaption><p>no data</p></figure>"
    days = sorted({d for s in series.values() for d, _ in s})
    width, height, left, bottom, top = 640, 240, 60, 30, 10
    top_value = max(points) or 1.0
    x_of = {d: left + (width - left - 10) * (i / max(len(days) - 1, 1)) for i, d in enumerate(days)}

    def y(v: float) -> float:
        return top + (height - top - bottom) * (1 - v / top_value)

    parts = [
        f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">',
        f'<line x1="{left}" y1="{y(0):.1f}" x2="{width - 10}" y2="{y(0):.1f}" stroke="#999"/>',
    ]
    for frac in (0.0, 0.5, 1.0):
        label = f"{top_value * frac * (100 if percent else 1):,.3g}{'%' if percent else ''}"
        parts.append(
            f'<text x="{left - 4}" y="{y(top_value * frac) + 4:.1f}" text-anchor="end" '
            f'font-size="10">{esc(label)}</text>'
        )
    for d in (days[0], days[-1]):
        parts.append(
            f'<text x="{x_of[d]:.1f}" y="{height - 8}" text-anchor="middle" '
            f'font-size="10">{esc(d)}</text>'
        )
    legend = []
    for i, (name, values) in enumerate(sorted(series.items())):
        color = _PALETTE[i % len(_PALETTE)]
        coords = " ".join(f"{x_of[d]:.1f},{y(v):.1f}" for d, v in sorted(values))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        for d, v in values:
            parts.append(f'<circle cx="{x_of[d]:.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>')
        legend.append(f'<span style="color:{color}">&#9632;</span> {esc(name)}')
    parts.append("</svg>")
    return (
        f"<figure><figcaption>{esc(title)} ({esc(unit)})</figcaption>{''.join(parts)}"
        f'<div class="legend">{" &nbsp; ".join(legend)}</div></figure>'
    )


def _html_table(report: Report, by: str) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(n)}</th>" for n in (by, *(c for c, _ in _COLUMNS)))
    body = []
    for r in [*rows_by(report, by), report.total]:
        cells = "".join(f"<td>{esc(cell(r, report.currency))}</td>" for _, cell in _COLUMNS)
        body.append(f"<tr><th>{esc(r.name)}</th>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def as_html(report: Report) -> str:
    esc = html.escape
    cost_series: dict[str, list[tuple[str, float]]] = defaultdict(list)
    util: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for d in report.days:
        if d.cost_per_m_tokens is not None:
            cost_series[d.model].append((d.day, d.cost_per_m_tokens))
        sums = util[d.pool][d.day]
        sums[0] += d.busy_gpu_hours
        sums[1] += d.gpu_hours
    util_series = {
        pool: [(day, b / g) for day, (b, g) in days.items() if g] for pool, days in util.items()
    }
    tenant_series: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for t in report.tenant_days:
        tenant_series[t.tenant].append((t.day, float(t.tokens)))
    header = "".join(f"<li>{esc(line)}</li>" for line in header_lines(report))
    tables = "".join(f"<h2>By {by}</h2>{_html_table(report, by)}" for by in BY)
    plots = "".join(
        [
            _svg_lines(
                "Cost per million tokens, per model and day",
                dict(cost_series),
                f"{report.currency} per M tokens",
            ),
            _svg_lines("Utilisation per pool and day", util_series, "busy GPU-time", percent=True),
            _svg_lines("Tokens per tenant and day", dict(tenant_series), "tokens"),
        ]
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>hpcserve report {esc(_when(report.since))} to {esc(_when(report.until))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
th:first-child {{ text-align: left; }}
figure {{ display: inline-block; margin: 0 1.5em 1.5em 0; width: 640px; }}
figcaption {{ font-weight: bold; margin-bottom: 0.3em; }}
.legend {{ font-size: 0.85em; }}
</style></head><body>
<h1>hpcserve: GPU-hours, tokens and cost</h1>
<ul>{header}</ul>
{plots}
{tables}
<p>How the figures are made: docs/architecture.md, "Usage, accounting and cost".</p>
</body></html>
"""
