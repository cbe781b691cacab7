"""`hpcserve health check`: one pass of the node's checks, one line per finding, an exit
code; by hand, or as Slurm's HealthCheckProgram (with --drain; see docs/architecture.md).

Exit codes: 0 nothing to act on (log-only findings are printed), 1 a finding asks for
stop_routing or worse, 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, Counter, write_to_textfile

from hpcserve.config import ConfigError, HealthConfig, PlatformConfig, load_config
from hpcserve.contracts.engine_token import FILE_ENV, read_token
from hpcserve.contracts.health_policy import severity, worst_action
from hpcserve.contracts.protocol import HealthFinding
from hpcserve.health.dcgm import dcgm_findings
from hpcserve.health.engine_checks import GenerationProbe
from hpcserve.health.gpu_checks import GpuChecks, XidWatcher, pci_map, select_gpus
from hpcserve.health.kernel_xids import read_kmsg, read_seq, write_seq, xids_since
from hpcserve.health.node_actions import NodeHealthActions
from hpcserve.health.nvml import NvmlUnavailable, fake_state_path, open_nvml
from hpcserve.health.policy import Policy
from hpcserve.health.resume import read_count, resume_step, write_count
from hpcserve.slurm.client import SlurmCLI
from hpcserve.slurm.parse import SlurmNode


def add_health_parser(sub: argparse._SubParsersAction) -> None:
    health = sub.add_parser("health", help="GPU and engine health checks")
    hsub = health.add_subparsers(dest="health_command", required=True, metavar="COMMAND")
    p = hsub.add_parser(
        "check",
        help="one pass of the node's checks: a line per finding, exit 1 if any needs action",
    )
    p.add_argument(
        "--config", help="platform config (TOML); default: $HPCSERVE_CONFIG, else defaults"
    )
    p.add_argument("--drain", action="store_true", help="drain this node in Slurm on a finding")
    p.add_argument(
        "--node", default="", help="Slurm node name (default: $SLURMD_NODENAME, hostname)"
    )
    p.add_argument(
        "--expect-gpus", type=int, default=None, help="GPUs the node must have (default: its GRES)"
    )
    p.add_argument("--fake-nvml", default="", help="state file of the fake NVML (tests only)")
    p.add_argument(
        "--xid-window-s", type=float, default=1.0, help="how long to listen for Xid events"
    )
    p.add_argument("--engine-url", default="", help="also probe this engine (one-token generation)")
    p.add_argument("--model", default="", help="with --engine-url: the served model name")
    p.add_argument(
        "--engine-token-file",
        default=os.environ.get(FILE_ENV, ""),
        help=f"with --engine-url: the engine token file (default: ${FILE_ENV}, else the "
        "config's engine.token_file)",
    )
    p.add_argument("--dcgm-diag", action="store_true", help="also run `dcgmi diag -r 1`")
    p.add_argument(
        "--kernel-log",
        default=None,
        help="read Xids the driver logged since the last check from here (default with "
        "--drain: /dev/kmsg; '' to skip)",
    )
    p.add_argument(
        "--state-dir",
        default="",
        help="where the check keeps its state (clean-check count, "
        "kernel log position); default health.check_state_dir",
    )
    p.add_argument("--metrics-file", default="", help="write the counters here (textfile format)")
    p.add_argument("-v", "--verbose", action="store_true", help="print NVML's readings per GPU")
    p.set_defaults(func=cmd_health_check)


def _config(arg: str | None) -> PlatformConfig:
    path = arg or os.environ.get("HPCSERVE_CONFIG", "")
    return load_config(Path(path)) if path else PlatformConfig()


def _node_name(arg: str) -> str:
    return arg or os.environ.get("SLURMD_NODENAME", "") or socket.gethostname().split(".")[0]


def _gres_gpus(gres: str) -> int:
    """GPUs in a node's GRES string: "gpu:4", "gpu:h100:8(S:0-1)", "gpu:a:2,gpu:b:2"."""
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if match:
            total += int(match.group(1))
    return total


class _Check:
    def __init__(self, args: argparse.Namespace, config: PlatformConfig) -> None:
        self.args = args
        self.config = config
        self.health: HealthConfig = config.health
        self.policy = Policy(self.health)
        self.node = _node_name(args.node)
        self.registry = CollectorRegistry()
        self.findings_total = Counter(
            "hpcserve_health_check_findings_total",
            "Findings of `hpcserve health check`, by check and action",
            ["check", "action"],
            registry=self.registry,
        )
        self._slurm: SlurmCLI | None = None
        self.pci: dict[str, int] = {}  # PCI bus id -> GPU index, for kernel-log Xids
        self.state_dir = Path(args.state_dir or self.health.check_state_dir)

    @property
    def slurm(self) -> SlurmCLI:
        if self._slurm is None:
            env = dict(os.environ)
            if self.config.slurm.conf:
                env["SLURM_CONF"] = self.config.slurm.conf
            self._slurm = SlurmCLI(env, timeout_s=10)
        return self._slurm

    def slurm_node(self) -> SlurmNode | None:
        return next((n for n in self.slurm.nodes() if n.name == self.node), None)

    def expected_gpus(self) -> int:
        if self.args.expect_gpus is not None:
            return int(self.args.expect_gpus)
        if not self.args.drain:
            return 0
        node = self.slurm_node()
        return _gres_gpus(node.gres) if node is not None else 0

    def gpu_findings(self, out: list[str]) -> list[HealthFinding]:
        if self.health.gpu_checks == "off":
            return []
        expected = self.expected_gpus()
        fake = fake_state_path(self.args.fake_nvml or self.health.fake_nvml, node=self.node)
        try:
            nvml = open_nvml(fake)
        except NvmlUnavailable as err:
            if expected:
                return [self.policy.finding("nvml_error", f"nvml unavailable: {err}")]
            out.append(f"no GPU checks: {err}")
            return []
        try:
            checks = GpuChecks(nvml, self.policy, expected=expected)
            self.pci = pci_map(nvml, select_gpus(nvml, None))
            if self.args.verbose:
                out.extend(checks.readings())
            watcher = XidWatcher(nvml, self.policy, select_gpus(nvml, None))
            try:
                findings = watcher.wait(self.args.xid_window_s)
            finally:
                watcher.close()
            return findings + checks.run()
        finally:
            nvml.nvmlShutdown()

    def kernel_findings(self, out: list[str]) -> list[HealthFinding]:
        path = self.args.kernel_log
        if path is None:
            path = "/dev/kmsg" if self.args.drain else ""
        records = read_kmsg(path) if path else []
        if not records:
            return []
        seq_file = self.state_dir / f"kmsg-{self.node}.seq"
        xids, newest = xids_since(records, read_seq(seq_file))
        try:
            write_seq(seq_file, newest)
        except OSError as err:
            out.append(f"kernel log: cannot keep its position in {seq_file}: {err}")
        findings = []
        for found in xids:
            gpu = self.pci.get(found.pci, -1)
            finding = self.policy.xid_finding(found.xid, gpu)
            if gpu < 0:
                detail = finding.detail.replace(
                    f"xid {found.xid}", f"xid {found.xid} pci {found.pci}"
                )
                finding = msgspec.structs.replace(finding, detail=detail)
            findings.append(finding)
        return findings

    def engine_findings(self) -> list[HealthFinding]:
        if not self.args.engine_url:
            return []
        token_file = self.args.engine_token_file
        if not token_file and os.path.exists(self.config.engine_token_path()):
            token_file = self.config.engine_token_path()
        token = read_token(token_file) if token_file else ""
        probe = GenerationProbe(self.args.engine_url, self.args.model, engine_token=token)
        result = probe.run(self.health.probe_deadline_s)
        if result.ok:
            if result.detail:
                print(f"engine probe: {result.detail}")
            return []
        return [self.policy.finding("engine_probe", f"engine probe: {result.detail}")]

    def run(self) -> int:
        started = time.monotonic()
        out: list[str] = []
        findings = self.gpu_findings(out) + self.kernel_findings(out) + self.engine_findings()
        findings += dcgm_findings(self.policy, diag=self.args.dcgm_diag)
        findings = list({f.detail: f for f in findings}.values())  # one line per finding
        for line in out:
            print(line)
        for finding in findings:
            self.findings_total.labels(finding.check, finding.action).inc()
            print(f"{finding.action} {finding.check}: {finding.detail}")
        worst = worst_action(findings)
        actionable = severity(worst) >= severity("stop_routing")
        if self.args.drain:
            self.node_actions(findings, worst)
        summary = f"{len(findings)} finding(s), worst: {worst}" if findings else "healthy"
        print(f"node {self.node}: {summary} ({time.monotonic() - started:.1f}s)")
        if self.args.metrics_file:
            write_to_textfile(self.args.metrics_file, self.registry)
        return 1 if actionable else 0

    def node_actions(self, findings: list[HealthFinding], worst: str) -> None:
        actions = NodeHealthActions(self.slurm, self.registry, prefix="hpcserve_health_check")
        if severity(worst) >= severity("drain"):
            drain = [f for f in findings if severity(f.action) >= severity("drain")]
            done = actions.act_on_node(self.node, drain, self.health)
            print(f"node {self.node}: {done}")
            healthy = False
        else:
            healthy = True
        needed = self.health.auto_resume_after
        if not needed:
            return
        state_file = self.state_dir / f"health-{self.node}.json"
        node = self.slurm_node()
        step = resume_step(
            read_count(state_file),
            healthy=healthy,
            drained=bool(node and node.drained),
            reason=node.reason if node else "",
            needed=needed,
        )
        if step.resume:
            self.slurm.resume_node(self.node)
            actions.actions.labels("resume").inc()
            print(f"node {self.node}: resumed after {step.why}")
        elif node is not None and node.drained:
            print(f"node {self.node}: stays drained: {step.why}")
        write_count(state_file, step.clean_checks)


def cmd_health_check(args: argparse.Namespace) -> int:
    from hpcserve.slurm.client import SlurmError

    try:
        config = _config(args.config)
    except ConfigError as err:
        print(f"hpcserve health check: config error: {err}", file=sys.stderr)
        return 2
    try:
        return _Check(args, config).run()
    except SlurmError as err:
        print(f"hpcserve health check: {err}", file=sys.stderr)
        return 2
