"""The in-job monitor: what a replica does with its reports (pure), the engine side that
tells the router, and how the job's environment configures the monitor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcserve.config import HealthConfig
from hpcserve.contracts import protocol as p
from hpcserve.health.monitor import (
    HealthMonitor,
    ReplicaHealth,
    Report,
    health_config_from_env,
    monitor_for_engine,
)
from hpcserve.health.policy import Policy
from hpcserve.health.replica import EngineHealth, WorkerHealth

POLICY = Policy()
XID79 = POLICY.xid_finding(79, 3)
XID13 = POLICY.xid_finding(13, 0)
HOT = POLICY.finding("temperature", "temperature 95C gpu 1", gpu=1)
STALLED = POLICY.finding("engine_probe", "engine probe: no answer within 5s")


def test_log_only_findings_are_reported_once_and_change_nothing() -> None:
    health = ReplicaHealth(give_up_s=60)
    first = health.update(Report([HOT], round=True), 0)
    assert first.report == [HOT] and not (first.leave or first.drain or first.rejoin)
    again = health.update(Report([HOT], round=True), 10)
    assert again.report == [] and health.in_service
    assert health.update(Report([XID13]), 11).report == [XID13]
    # Gone in a round, then back: reported again.
    health.update(Report([], round=True), 20)
    assert health.update(Report([HOT], round=True), 30).report == [HOT]


def test_a_node_fault_drains_the_replica_once() -> None:
    health = ReplicaHealth(give_up_s=60)
    decision = health.update(Report([XID79]), 5)
    assert decision.leave and decision.drain and decision.report == [XID79]
    assert not health.in_service
    later = health.update(Report([], round=True), 6)
    assert not (later.leave or later.drain or later.rejoin), "draining stays draining"


def test_an_engine_finding_leaves_routing_and_rejoins_after_a_clean_round() -> None:
    health = ReplicaHealth(give_up_s=60)
    out = health.update(Report([STALLED], round=True), 0)
    assert out.leave and not out.drain and not health.in_service
    still = health.update(Report([STALLED], round=True), 10)
    assert not still.leave and still.report == [] and not still.rejoin
    # An Xid report is no round: it cannot bring the replica back.
    assert not health.update(Report([XID13]), 11).rejoin
    back = health.update(Report([], round=True), 20)
    assert back.rejoin and health.in_service


def test_an_engine_that_stays_broken_is_given_up() -> None:
    health = ReplicaHealth(give_up_s=60)
    health.update(Report([STALLED], round=True), 0)
    assert health.update(Report([STALLED], round=True), 59).give_up == ""
    gave_up = health.update(Report([STALLED], round=True), 61).give_up
    assert gave_up.startswith("out of routing for 61s (health.give_up_s 60)")
    assert "engine probe: no answer within 5s" in gave_up


class FakeAgent:
    def __init__(self) -> None:
        self.registered = True
        self.sent: list[p.RegistryMessage] = []
        self.registrations = 0

    def register(self) -> None:
        self.registrations += 1

    def send(self, message: p.RegistryMessage) -> None:
        self.sent.append(message)

    def close(self) -> None:
        self.closed = True


class ScriptedMonitor(HealthMonitor):
    def __init__(self, reports: list[Report]) -> None:
        super().__init__(HealthConfig(give_up_s=30), engine_url="http://127.0.0.1:9", model="m")
        self.script = reports

    def reports(self) -> list[Report]:
        out, self.script = self.script, []
        return out


REG = p.Register("r1", "m", "http://n1:8000", pool="p", slurm_job_id=42, node="n1")


def test_engine_health_tells_the_router_and_drains() -> None:
    agent, drains, give_ups = FakeAgent(), [], []
    monitor = ScriptedMonitor([Report([HOT, XID79])])
    health = EngineHealth(
        monitor, agent, REG, on_drain=drains.append, on_give_up=give_ups.append, clock=lambda: 0
    )
    health.step()
    assert agent.sent == [p.HealthReport("r1", [HOT, XID79], node="n1", slurm_job_id=42, pool="p")]
    assert drains == ["health: hpcserve: xid 79 gpu 3; temperature 95C gpu 1"]
    assert not agent.registered and not health.in_service and give_ups == []


def test_engine_health_rejoins_and_gives_up() -> None:
    agent, give_ups = FakeAgent(), []
    clock = iter([0.0, 5.0, 10.0, 50.0])
    monitor = ScriptedMonitor([Report([STALLED], round=True), Report([], round=True)])
    health = EngineHealth(
        monitor, agent, REG, on_drain=pytest.fail, on_give_up=give_ups.append,
        clock=lambda: next(clock),
    )  # fmt: skip
    health.step()
    assert agent.registrations == 1 and health.in_service, "left, then rejoined"
    monitor.script = [Report([STALLED], round=True), Report([STALLED], round=True)]
    health.step()
    assert not health.in_service and len(give_ups) == 1


def test_monitor_from_the_job_environment(tmp_path: Path) -> None:
    state = tmp_path / "nvml-n1.json"
    state.write_text(json.dumps({"gpus": [{}, {}]}))
    cfg = HealthConfig(probe_interval_s=0.5, fake_nvml=str(tmp_path / "nvml-{node}.json"))
    env = {"HPCSERVE_HEALTH": json.dumps({"probe_interval_s": 0.5, "fake_nvml": cfg.fake_nvml})}
    assert health_config_from_env(env) == cfg
    assert health_config_from_env({}) == HealthConfig()
    with pytest.raises(ValueError, match="HPCSERVE_HEALTH"):
        health_config_from_env({"HPCSERVE_HEALTH": '{"probe_interval_s": -1}'})

    common = {"engine_url": "http://127.0.0.1:9", "model": "m", "node": "n1"}
    faked = monitor_for_engine(engine="sim", env=env | {"SLURM_GPUS_ON_NODE": "1"}, **common)
    assert faked is not None and faked.xids is not None and faked.xids.watched == [0, 1]
    assert faked.gpu_checks is not None and faked.gpu_checks.expected == 1
    faked.stop()
    # Without a fake, CPU and simulated engines have no GPUs to check.
    plain = monitor_for_engine(engine="sim", env={}, **common)
    assert plain is not None and plain.gpu_checks is None
    off = monitor_for_engine(engine="sim", env={"HPCSERVE_HEALTH": '{"monitor": false}'}, **common)
    assert off is None
    # A GPU engine on a machine without NVML: a warning, and no GPU checks (vLLM fails anyway).
    gpu = monitor_for_engine(engine="vllm", env={}, **common)
    assert gpu is not None and gpu.gpu_checks is None


def test_a_check_round_probes_the_engine(tmp_path: Path) -> None:
    monitor = HealthMonitor(
        HealthConfig(probe_deadline_s=1), engine_url="http://127.0.0.1:9", model="m"
    )
    report = monitor.check_round()
    assert report.round
    assert [(f.check, f.action) for f in report.findings] == [("engine_probe", "stop_routing")]
    assert "unreachable" in report.findings[0].detail


class QueuedEngine:
    """A stand-in engine whose generation requests wait behind a queue (they never answer),
    and whose /metrics shows requests waiting and, when `moving`, tokens flowing."""

    def __init__(self, *, moving: bool) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.tokens = 0
        self.release = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                engine.tokens += 50 if moving else 0
                body = (
                    "vllm:num_requests_running 4.0\nvllm:num_requests_waiting 9.0\n"
                    f"vllm:generation_tokens_total {engine.tokens}.0\n"
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                engine.release.wait(30)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("moving", [True, False])
def test_a_probe_stuck_behind_a_queue_of_a_working_engine_is_not_a_finding(moving: bool) -> None:
    engine = QueuedEngine(moving=moving)
    try:
        monitor = HealthMonitor(
            HealthConfig(probe_deadline_s=0.5), engine_url=engine.url, model="m"
        )
        report = monitor.check_round()
    finally:
        engine.close()
    checks = [f.check for f in report.findings]
    # Overloaded (tokens flow): stays in routing. Hung (nothing moves): leaves it.
    assert checks == ([] if moving else ["engine_probe"])


def test_giving_up_kills_vllm_and_its_stopped_children() -> None:
    import os
    import signal
    import time

    from hpcserve.engine_launch.engine import EngineOptions, EngineRunner
    from hpcserve.engine_launch.process_tree import VllmTree

    runner = EngineRunner(EngineOptions("/nonexistent", "m", "tcp://127.0.0.1:1", engine="sim"))
    # A stand-in for vLLM: an API process with a child "core" that is stopped (SIGSTOP).
    runner.process = tree = VllmTree(["bash", "-c", "sleep 300 & sleep 300 & wait"], dict(os.environ))
    deadline = time.monotonic() + 30
    while len(children := [p for p in tree.members() if p != tree.pid]) < 2:
        assert time.monotonic() < deadline, f"bash started {len(children)} of its 2 children"
        time.sleep(0.02)
    assert len(children) == 2
    os.kill(children[0], signal.SIGSTOP)
    runner._give_up("engine probe: no answer within 5s")
    assert runner.stop_vllm() == -signal.SIGKILL

    def state(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return "gone"

    # SIGKILL was sent to every child; each dies as soon as the kernel runs it.
    deadline = time.monotonic() + 30
    while running := {pid: s for pid in children if (s := state(pid)) not in ("Z", "gone")}:
        assert time.monotonic() < deadline, f"children still running: {running}"
        time.sleep(0.02)


def test_the_pool_manager_passes_the_health_table_to_the_job() -> None:
    from hpcserve.config import parse_config
    from hpcserve.poolmgr.spec import build_job_spec

    pool = {"name": "p", "model_path": "/m", "engine": "sim"}
    default = parse_config({"pools": [pool]})
    assert "HPCSERVE_HEALTH" not in dict(build_job_spec(default, default.pools[0]).env)
    tuned = parse_config({"pools": [pool], "health": {"probe_interval_s": 2, "stall_s": 20}})
    env = dict(build_job_spec(tuned, tuned.pools[0]).env)
    assert health_config_from_env(env) == tuned.health


def test_a_worker_rank_reports_node_faults_and_stops_its_workers() -> None:
    agent = FakeAgent()
    rank1 = p.Register("r1-rank1", "m", "", pool="p", slurm_job_id=42, node="n2")
    monitor = ScriptedMonitor([Report([XID13]), Report([HOT], round=True)])
    health = WorkerHealth(monitor, agent, rank1)
    assert health.step() == "" and agent.sent == [], "log-only findings stay in the job log"
    monitor.script = [Report([XID79])]
    assert health.step() == "hpcserve: xid 79 gpu 3"
    assert agent.sent == [p.HealthReport("r1-rank1", [XID79], node="n2", slurm_job_id=42, pool="p")]
    health.stop()
    assert agent.closed


def test_a_monitor_without_an_engine_url_checks_only_the_gpus(tmp_path: Path) -> None:
    state = tmp_path / "nvml-n2.json"
    state.write_text(json.dumps({"gpus": [{}, {}]}))
    env = {"HPCSERVE_HEALTH": json.dumps({"fake_nvml": str(tmp_path / "nvml-{node}.json")})}
    monitor = monitor_for_engine(engine="vllm", engine_url="", model="m", node="n2", env=env)
    assert monitor is not None and monitor.gpu_checks is not None
    try:
        assert monitor.check_round() == Report([], round=True)
        state.write_text(json.dumps({"gpus": [{}, {"ecc_uncorrected_volatile": 2}]}))
        (finding,) = monitor.check_round().findings
        assert finding.gpu == 1 and finding.action != "log"
    finally:
        monitor.stop()
