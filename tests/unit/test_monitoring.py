"""deploy/: the Prometheus rules (promtool's own checks and unit tests), the Grafana
dashboards (up to date with their spec, every query parsed by promtool), the example scrape
config; and the pool manager's file_sd scrape targets."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import msgspec

from hpcserve.contracts.protocol import ReplicaInfo, ReplicaLoad
from hpcserve.poolmgr.scrape_targets import ScrapeTargetsFile, target_groups

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
PROMTOOL = shutil.which("promtool")

def _promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is missing (Debian's prometheus package)"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_rules_pass_promtools_checks():
    done = _promtool("check", "rules", "hpcserve-rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say():
    done = _promtool("test", "rules", "hpcserve-rules.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_unit_test_and_says_what_to_do():
    rules = (PROMETHEUS / "hpcserve-rules.yml").read_text()
    tests = (PROMETHEUS / "hpcserve-rules.test.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if "- alert:" in line]
    assert len(alerts) >= 10
    untested = [a for a in alerts if f"alertname: {a}\n" not in tests]
    assert not untested, f"alerts without a promtool unit test: {untested}"
    assert rules.count("description:") == len(alerts)


def test_the_example_scrape_config_is_valid(tmp_path):
    # promtool checks that the metrics token file it names exists: a stand-in here.
    token = tmp_path / "hpcserve-metrics-token"
    token.write_text("x\n")
    example = (PROMETHEUS / "prometheus.example.yml").read_text()
    assert "/etc/prometheus/hpcserve-metrics-token" in example
    (tmp_path / "prometheus.yml").write_text(
        example.replace("/etc/prometheus/hpcserve-metrics-token", str(token))
    )
    shutil.copy(PROMETHEUS / "hpcserve-rules.yml", tmp_path)
    done = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_example_sends_the_metrics_token_to_every_hpcserve_service():
    example = (PROMETHEUS / "prometheus.example.yml").read_text()
    # Each job's block: from its "- job_name:" to the next (the file is flat, one level).
    blocks = example.split("  - job_name: ")[1:]
    jobs = {block.split()[0]: block for block in blocks}
    services = ("hpcserve-gateway", "hpcserve-router", "hpcserve-poolmgr", "hpcserve-batch")
    for name in services:  # their /metrics answer 401 without it (contracts/metrics_http.py)
        assert "credentials_file: /etc/prometheus/hpcserve-metrics-token" in jobs[name], name
    assert "authorization" not in jobs["hpcserve-engines"]  # vLLM's /metrics is open


def test_the_dashboards_are_up_to_date_with_their_spec():
    done = subprocess.run(
        [sys.executable, str(GRAFANA / "dashboards.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboards_cover_what_an_operator_looks_at():
    titles = {}
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        assert board["uid"] == path.stem
        assert board["panels"], path.name
        for panel in board["panels"]:
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        titles[path.stem] = board
    assert {
        "hpcserve-fleet",
        "hpcserve-slo",
        "hpcserve-models",
        "hpcserve-tenants",
        "hpcserve-gpus",
        "hpcserve-slurm",
        "hpcserve-batch",
    } <= set(titles)
    variables = {v["name"] for v in titles["hpcserve-tenants"]["templating"]["list"]}
    assert {"datasource", "tenant", "model"} <= variables
    # Model onboarding: online quality per deployment, rollouts, numerical canaries.
    queries = " ".join(t["expr"] for p in titles["hpcserve-models"]["panels"] for t in p["targets"])
    for family in (
        "gateway_deployment_errors",
        "gateway_deployment_truncations",
        "gateway_deployment_refusals",
        "gateway_deployment_structured_invalid",
        "rollout_share",
        "router_canary_checks",
    ):
        assert f"hpcserve_{family}" in queries, family


def test_every_panel_query_parses(tmp_path):
    exprs = json.loads(
        subprocess.run(
            [sys.executable, str(GRAFANA / "dashboards.py"), "--exprs"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    # promtool parses PromQL inside rule files: each query becomes a recording rule.
    rules = {
        "groups": [
            {
                "name": "panels",
                "rules": [{"record": f"panel_{i}", "expr": e} for i, e in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "panels.yml"
    path.write_text(json.dumps(rules))
    done = _promtool("check", "rules", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def _replica(replica_id: str, url: str, pool: str = "chat") -> ReplicaInfo:
    return ReplicaInfo(
        replica_id=replica_id,
        model="tiny",
        url=url,
        pool=pool,
        slurm_job_id=42,
        node="n1",
        age_s=1.0,
        last_seen_age_s=0.1,
        in_flight=0,
        load=ReplicaLoad(),
    )


def test_scrape_targets_name_each_engine_with_its_pool_and_model():
    groups = target_groups(
        [_replica("b", "http://n2:8001"), _replica("a", "http://n1:8001", pool="embed")]
    )
    assert [(g.targets, g.labels["pool"], g.labels["replica_id"]) for g in groups] == [
        (["n1:8001"], "embed", "a"),
        (["n2:8001"], "chat", "b"),
    ]
    assert groups[0].labels == {
        "pool": "embed",
        "model": "tiny",
        "replica_id": "a",
        "slurm_job_id": "42",
        "node": "n1",
    }


def test_the_targets_file_is_rewritten_only_when_replicas_change(tmp_path):
    path = tmp_path / "sd" / "engines.json"
    targets = ScrapeTargetsFile(path)
    targets.update([_replica("a", "http://n1:8001")])
    first = path.stat()
    assert stat.S_IMODE(first.st_mode) == 0o644  # Prometheus runs as another account
    decoded = msgspec.json.decode(path.read_bytes())
    assert decoded == [{"targets": ["n1:8001"], "labels": decoded[0]["labels"]}]
    targets.update([_replica("a", "http://n1:8001")])
    assert path.stat().st_ino == first.st_ino  # unchanged: not rewritten
    targets.update([])
    assert msgspec.json.decode(path.read_bytes()) == []


def test_a_targets_file_that_cannot_be_written_is_retried_not_fatal(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    targets = ScrapeTargetsFile(blocker / "engines.json")
    targets.update([_replica("a", "http://n1:8001")])
    targets.update([_replica("a", "http://n1:8001")])
    assert caplog.text.count("cannot write the scrape targets") == 1


def test_the_slurm_dashboard_shows_the_autoscalers_slo_cold_start_forecast_and_wake_holds():
    board = json.loads((GRAFANA / "dashboards" / "hpcserve-slurm.json").read_text())
    queries = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for family in (
        "poolmgr_autoscale_slo_p95_seconds",
        "poolmgr_autoscale_slo_objective_seconds",
        "poolmgr_cold_start_seconds",
        "poolmgr_autoscale_rate_rps",
        "poolmgr_autoscale_request_seconds",
        "poolmgr_autoscale_capacity_in_flight",
        "gateway_wake_holds_total",
    ):
        assert f"hpcserve_{family}" in queries, family
