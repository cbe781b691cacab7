"""hpcserve's Grafana dashboards, written from one spec: `python deploy/grafana/dashboards.py`
writes deploy/grafana/dashboards/*.json; `--check` fails when a file differs from the spec
(CI runs it), `--exprs` prints every panel query (tests parse each one with promtool).

Every panel reads series that hpcserve's components, vLLM or NVIDIA's DCGM exporter export
under the job names of deploy/prometheus/prometheus.example.yml.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# dashboard uid -> (title, variables, rows of (panel title, unit, [(legend, expr)]))
Panel = tuple[str, str, list[tuple[str, str]]]
M = 'model=~"$model"'
VM = 'model_name=~"$model"'
P = 'pool=~"$pool"'
T = 'tenant=~"$tenant"'

DASHBOARDS: dict[str, tuple[str, list[str], list[Panel]]] = {
    "hpcserve-fleet": (
        "hpcserve / fleet overview",
        ["model", "pool"],
        [
            ("Live replicas by model", "short", [("{{model}}", f"sum by (model) (hpcserve_router_replicas{{{M}}})")]),
            ("Requests per second by model", "reqps", [("{{model}}", f"sum by (model) (rate(hpcserve_gateway_requests_total{{{M}}}[5m]))")]),
            ("Server errors (5xx) share", "percentunit", [("{{model}}", f"model:hpcserve_gateway_server_errors:ratio_rate5m{{{M}}}")]),
            ("Time to first token p95", "s", [("{{model}}", f"model:hpcserve_gateway_ttft_seconds:p95_5m{{{M}}}")]),
            ("Tokens per second", "short", [("{{model}} {{direction}}", f"model:hpcserve_gateway_tokens:rate5m{{{M}}}")]),
            ("Requests in flight (gateways)", "short", [("{{instance}}", "sum by (instance) (hpcserve_gateway_in_flight)")]),
            ("Replicas wanted vs running", "short", [
                ("{{pool}} wanted", f"max by (pool) (hpcserve_poolmgr_desired_replicas{{{P}}})"),
                ("{{pool}} running", f'sum by (pool) (hpcserve_poolmgr_jobs{{{P},state="RUNNING"}})'),
            ]),
            ("Routing decisions by outcome", "ops", [("{{outcome}}", "sum by (outcome) (rate(hpcserve_router_routes_total[5m]))")]),
        ],
    ),
    "hpcserve-slo": (
        "hpcserve / SLO per model",
        ["model"],
        [
            ("TTFT p95 (objective 2.5 s)", "s", [("{{model}}", f"model:hpcserve_gateway_ttft_seconds:p95_5m{{{M}}}")]),
            ("Time per output token p95", "s", [("{{model}}", f"model:hpcserve_gateway_tpot_seconds:p95_5m{{{M}}}")]),
            ("Goodput: requests within the TTFT objective", "percentunit", [("{{model}}", f"1 - model:hpcserve_gateway_ttft_slow:ratio_rate5m{{{M}}}")]),
            ("Error budget burn rate (1 h, 99.9%)", "short", [("{{model}}", f"model:hpcserve_gateway_server_errors:ratio_rate1h{{{M}}} / 0.001")]),
            ("Rate-limited requests (429) per second", "reqps", [("{{model}}", f'sum by (model) (rate(hpcserve_gateway_requests_total{{{M},status="429"}}[5m]))')]),
            ("Gateway queue time p95 (routing)", "s", [("p95", "histogram_quantile(0.95, sum by (le) (rate(hpcserve_gateway_queue_seconds_bucket[5m])))")]),
            ("Request duration p95 by endpoint", "s", [("{{endpoint}}", "histogram_quantile(0.95, sum by (endpoint, le) (rate(hpcserve_gateway_request_seconds_bucket[5m])))")]),
        ],
    ),
    "hpcserve-models": (
        "hpcserve / engines per model",
        ["model"],
        [
            ("Prompt and generation tokens per second", "short", [
                ("{{model_name}} prompt", f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{VM}}}[5m]))"),
                ("{{model_name}} generation", f"sum by (model_name) (rate(vllm:generation_tokens_total{{{VM}}}[5m]))"),
            ]),
            ("Prefix-cache hit rate", "percentunit", [("{{model_name}}", f"model:vllm_prefix_cache_hit:ratio_rate5m{{{VM}}}")]),
            ("KV-cache usage by engine", "percentunit", [("{{instance}}", f"vllm:kv_cache_usage_perc{{{VM}}}")]),
            ("Requests running and waiting", "short", [
                ("{{model_name}} running", f"sum by (model_name) (vllm:num_requests_running{{{VM}}})"),
                ("{{model_name}} waiting", f"sum by (model_name) (vllm:num_requests_waiting{{{VM}}})"),
            ]),
            ("Preemptions per second", "ops", [("{{model_name}}", f"sum by (model_name) (rate(vllm:num_preemptions_total{{{VM}}}[5m]))")]),
            ("Prompt tokens the router found cached", "percentunit", [("{{model}}", f"sum by (model) (rate(hpcserve_router_cached_prompt_tokens_total{{{M}}}[5m])) / sum by (model) (rate(hpcserve_router_prompt_tokens_total{{{M}}}[5m]))")]),
            # Online quality per deployment (gateway/quality.py): model asked for x version.
            ("Deployment quality by version (share of answers; JSON: of structured ones)", "percentunit", [
                (f"{{{{model}}}} {{{{version}}}} {what}", f"sum by (model, version) (rate(hpcserve_gateway_deployment_{num}_total{{{M}}}[5m])) / sum by (model, version) (rate(hpcserve_gateway_deployment_{den}_total{{{M}}}[5m]))")
                for what, num, den in (("errors", "errors", "answers"), ("truncated", "truncations", "answers"),
                                       ("refusals", "refusals", "answers"), ("invalid JSON", "structured_invalid", "structured"))
            ]),
            ("Staged rollouts: share to the new version", "percent", [("{{alias}}", "hpcserve_rollout_share_percent")]),
            ("Numerical canary checks per hour by version and result", "short", [("{{model_ref}} {{stage}} {{result}}", "sum by (model_ref, stage, result) (increase(hpcserve_router_canary_checks_total[1h]))")]),
        ],
    ),
    "hpcserve-tenants": (
        "hpcserve / tenants",
        ["tenant", "model"],
        [
            ("Requests per second by tenant", "reqps", [("{{tenant}}", f"sum by (tenant) (rate(hpcserve_gateway_requests_total{{{T},{M}}}[5m]))")]),
            ("Tokens per second by tenant", "short", [("{{tenant}} {{direction}}", f"sum by (tenant, direction) (rate(hpcserve_gateway_tokens_total{{{T},{M}}}[5m]))")]),
            ("Limits hit per second", "reqps", [("{{tenant}} {{limit}}", f"tenant:hpcserve_gateway_quota_rejections:rate5m{{{T}}}")]),
            ("Tokens in the last 24 h by tenant", "short", [("{{tenant}}", f"sum by (tenant) (increase(hpcserve_gateway_tokens_total{{{T}}}[24h]))")]),
            ("Overflow to the external API", "reqps", [("{{tenant}}", f"sum by (tenant) (rate(hpcserve_gateway_overflow_total{{{T}}}[5m]))")]),
        ],
    ),
    "hpcserve-gpus": (
        "hpcserve / GPUs and nodes",
        [],
        [
            ("GPU utilisation (DCGM)", "percent", [("{{Hostname}} gpu{{gpu}}", "DCGM_FI_DEV_GPU_UTIL")]),
            ("GPU memory used (DCGM)", "decmbytes", [("{{Hostname}} gpu{{gpu}}", "DCGM_FI_DEV_FB_USED")]),
            ("GPU power (DCGM)", "watt", [("{{Hostname}} gpu{{gpu}}", "DCGM_FI_DEV_POWER_USAGE")]),
            ("Xid errors (DCGM)", "short", [("{{Hostname}} gpu{{gpu}}", "DCGM_FI_DEV_XID_ERRORS")]),
            ("Health findings by check and action", "short", [("{{check}} -> {{action}}", "sum by (check, action) (increase(hpcserve_router_health_findings_total[1h]))")]),
            ("Findings of node health checks (hpcserve health check)", "short", [("{{check}} -> {{action}}", "sum by (check, action) (increase(hpcserve_health_check_findings_total[1h]))")]),
        ],
    ),
    "hpcserve-slurm": (
        "hpcserve / Slurm jobs",
        ["pool"],
        [
            ("Jobs by pool and state", "short", [("{{pool}} {{state}}", f"sum by (pool, state) (hpcserve_poolmgr_jobs{{{P}}})")]),
            ("Pool manager actions per minute", "short", [("{{pool}} {{kind}}", f"sum by (pool, kind) (rate(hpcserve_poolmgr_actions_total{{{P}}}[5m])) * 60")]),
            ("Slurm command errors per minute", "short", [("{{op}}", "sum by (op) (rate(hpcserve_poolmgr_slurm_errors_total[5m])) * 60")]),
            ("Pool manager poll duration", "s", [("poll", "max(hpcserve_poolmgr_last_poll_seconds)")]),
            ("Replicas each pool is short of", "short", [("{{pool}}", f"pool:hpcserve_poolmgr_replicas_missing{{{P}}}")]),
            ("Autoscaler target and decisions", "short", [
                ("{{pool}} target", f"hpcserve_poolmgr_autoscale_target{{{P}}}"),
                ("{{pool}} {{direction}} per hour", f"sum by (pool, direction) (increase(hpcserve_poolmgr_autoscale_decisions_total{{{P}}}[1h]))"),
            ]),
            # Autoscaled pools (issue 19): the SLO they hold, the cold start they scale ahead
            # by, the forecast, and requests held while a pool at zero wakes.
            ("Autoscaled pools: TTFT/TPOT p95 against the SLO", "s", [
                ("{{pool}} {{slo}} p95 {{window}}", f"max by (pool, slo, window) (hpcserve_poolmgr_autoscale_slo_p95_seconds{{{P}}})"),
                ("{{pool}} {{slo}} SLO", f"max by (pool, slo) (hpcserve_poolmgr_autoscale_slo_objective_seconds{{{P}}})"),
            ]),
            ("Autoscaled pools: measured cold start (queue, startup medians; total p90)", "s", [("{{pool}} {{part}}", f"max by (pool, part) (hpcserve_poolmgr_cold_start_seconds{{{P}}})")]),
            ("Autoscaled pools: arrivals now and forecast one cold start ahead", "reqps", [("{{pool}} {{kind}}", f"max by (pool, kind) (hpcserve_poolmgr_autoscale_rate_rps{{{P}}})")]),
            ("Autoscaled pools: a request's time in a replica, measured and modelled", "s", [("{{pool}} {{source}}", f"max by (pool, source) (hpcserve_poolmgr_autoscale_request_seconds{{{P}}})")]),
            ("Autoscaled pools: one replica's capacity in flight, measured (TPOT at the SLO) and modelled", "short", [("{{pool}} {{source}}", f"max by (pool, source) (hpcserve_poolmgr_autoscale_capacity_in_flight{{{P}}})")]),
            ("Requests held while a pool wakes from zero, per hour (timeout: answered 503)", "short", [("{{model}} {{outcome}}", "sum by (model, outcome) (increase(hpcserve_gateway_wake_holds_total[1h]))")]),
        ],
    ),
    "hpcserve-batch": (
        "hpcserve / Batch API",
        ["pool"],
        [
            ("Backlog (requests not yet answered)", "short", [("{{pool}}", f"hpcserve_poolmgr_batch_backlog_requests{{{P}}}")]),
            ("Batch pool replicas", "short", [("{{pool}} {{kind}}", f"hpcserve_poolmgr_batch_replicas{{{P}}}")]),
            ("Batch requests per second by outcome", "reqps", [("{{outcome}}", "sum by (outcome) (rate(hpcserve_batch_requests_total[5m]))")]),
            ("Batch tokens per second", "short", [("{{kind}}", "sum by (kind) (rate(hpcserve_batch_tokens_total[5m]))")]),
            ("Batch requests in flight", "short", [("in flight", "sum(hpcserve_batch_in_flight)")]),
            ("Time to empty the backlog at the current rate", "s", [("{{pool}}", f'hpcserve_poolmgr_batch_backlog_requests{{{P}}} / scalar(sum(rate(hpcserve_batch_requests_total{{outcome="ok"}}[15m])))')]),
        ],
    ),
    "hpcserve-cost": (
        "hpcserve / cost",
        ["pool", "model", "tenant"],
        [
            ("GPU cost per hour by pool (cost.gpu_hour_price)", "currencyUSD", [("{{pool}}", f"pool:hpcserve_gpu_cost_per_hour{{{P}}}")]),
            ("Cost per million tokens (last hour's tokens)", "currencyUSD", [("{{model}}", f"model:hpcserve_cost_per_million_tokens:rate1h{{{M}}}")]),
            ("GPUs held by running jobs", "short", [("{{pool}}", f"hpcserve_poolmgr_pool_gpus{{{P}}}")]),
            ("Idle GPUs (no request running on the replica)", "short", [("{{model}}", f"model:hpcserve_idle_gpus{{{M}}}")]),
            ("Idle GPU-hours in the last 24 h", "short", [("{{model}}", f"avg_over_time(model:hpcserve_idle_gpus{{{M}}}[24h]) * 24")]),
            ("Token share by tenant, last 24 h (chargeback)", "percentunit", [("{{tenant}}", f"sum by (tenant) (increase(hpcserve_gateway_tokens_total{{{T}}}[24h])) / scalar(sum(increase(hpcserve_gateway_tokens_total[24h])))")]),
        ],
    ),
}

VARIABLES = {
    "model": "label_values(hpcserve_router_replicas, model)",
    "pool": "label_values(hpcserve_poolmgr_desired_replicas, pool)",
    "tenant": "label_values(hpcserve_gateway_requests_total, tenant)",
}


def _variable(name: str) -> dict[str, object]:
    return {
        "name": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": VARIABLES[name], "refId": name},
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
    }


def dashboard(uid: str) -> dict[str, object]:
    title, variables, panels = DASHBOARDS[uid]
    datasource = {
        "name": "datasource",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
    }
    out_panels = []
    for i, (panel_title, unit, targets) in enumerate(panels):
        out_panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": panel_title,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                    for j, (legend, expr) in enumerate(targets)
                ],
            }
        )
    return {
        "uid": uid,
        "title": title,
        "tags": ["hpcserve"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [datasource, *(_variable(v) for v in variables)]},
        "panels": out_panels,
    }


def rendered() -> dict[str, str]:
    return {
        f"{uid}.json": json.dumps(dashboard(uid), indent=2, sort_keys=True) + "\n"
        for uid in DASHBOARDS
    }


def exprs() -> list[str]:
    return [expr for _, _, panels in DASHBOARDS.values() for _, _, t in panels for _, expr in t]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is not up to date")
    parser.add_argument("--exprs", action="store_true", help="print every panel query as JSON")
    args = parser.parse_args()
    if args.exprs:
        print(json.dumps(exprs()))
        return 0
    stale = []
    for name, text in rendered().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"not up to date: {', '.join(stale)}; run python deploy/grafana/dashboards.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
