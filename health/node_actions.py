"""The pool manager's node actions on health findings: it runs on the control node with
Slurm operator rights, so it is the one that drains nodes.

Each poll it reads the health events the router holds (engines report them there), and for
every finding whose action is drain or drain_reset it drains the finding's node in Slurm
with a reason an admin reads (`hpcserve: xid 79 gpu 3`), then, for drain_reset, runs the
site's reset hook. A node already drained (by an admin, or earlier) is left as it is: its
reason is never overwritten. The jobs that reported such findings drain themselves; the
caller counts them as draining, so their capacity is replaced at once (on another node:
Slurm puts nothing new on a drained one). Events are acknowledged once acted on; a Slurm
error leaves the rest for the next poll. Every action is one log line and a counter.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from hpcserve.config import HealthConfig
from hpcserve.contracts.health_policy import drain_reason, severity
from hpcserve.contracts.protocol import HealthEvent, HealthEvents, HealthFinding
from hpcserve.contracts.router_client import RouterQueryError, list_health_events
from hpcserve.slurm.client import SlurmClient, SlurmError

log = logging.getLogger(__name__)

HookRunner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


def _run_hook(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def hook_argv(template: Sequence[str], node: str, reason: str) -> list[str]:
    return [arg.replace("{node}", node).replace("{reason}", reason) for arg in template]


class NodeHealthActions:
    def __init__(
        self,
        slurm: SlurmClient,
        registry: CollectorRegistry,
        *,
        fetch: Callable[[str, str, int], HealthEvents] = list_health_events,
        run_hook: HookRunner = _run_hook,
        prefix: str = "hpcserve_poolmgr",
    ) -> None:
        self.slurm = slurm
        self._fetch = fetch
        self._run_hook = run_hook
        self.epoch = ""
        self.acked = 0
        self.events = Counter(
            f"{prefix}_health_events_total",
            "Health findings learnt from the router, by check and action",
            ["check", "action"],
            registry=registry,
        )
        self.actions = Counter(
            f"{prefix}_health_actions_total",
            "Node actions taken on health findings, by kind",
            ["kind"],
            registry=registry,
        )

    def poll(self, endpoint: str, config: HealthConfig) -> set[int]:
        """Act on new events; the jobs that drain themselves for a node finding."""
        try:
            reply = self._fetch(endpoint, self.epoch, self.acked)
        except RouterQueryError as err:
            log.warning("cannot read health events from the router: %s", err)
            return set()
        if reply.epoch != self.epoch:
            self.epoch, self.acked = reply.epoch, 0
        fresh = [e for e in reply.events if e.seq > self.acked]
        draining: set[int] = set()
        by_node: dict[str, list[HealthEvent]] = {}
        for event in fresh:
            self.events.labels(event.finding.check, event.finding.action).inc()
            if severity(event.finding.action) >= severity("drain"):
                by_node.setdefault(event.node, []).append(event)
                if event.slurm_job_id:
                    draining.add(event.slurm_job_id)
        try:
            for node, events in by_node.items():
                self.act_on_node(node, [e.finding for e in events], config)
        except SlurmError as err:
            log.error("health: cannot drain a node, retrying next poll: %s", err)
            self.actions.labels("drain_failed").inc()
            return draining
        if fresh:
            self.acked = fresh[-1].seq
        return draining

    def act_on_node(self, node: str, findings: list[HealthFinding], config: HealthConfig) -> str:
        """Drain the node for these findings (and reset for drain_reset); what was done."""
        reason = drain_reason(findings)
        if not node:
            log.warning("health: %s reported without a node; nothing to drain", reason)
            self.actions.labels("no_node").inc()
            return "no node"
        current = next((n for n in self.slurm.nodes() if n.name == node), None)
        if current is not None and current.drained:
            log.info(
                "health: node %s is already drained (%s); leaving it: %s",
                node,
                current.reason or "no reason",
                reason,
            )
            self.actions.labels("already_drained").inc()
            return f"already drained ({current.reason or 'no reason'})"
        self.slurm.drain_node(node, reason)
        self.actions.labels("drain").inc()
        log.warning("health: node %s drained: %s", node, reason)
        if any(f.action == "drain_reset" for f in findings):
            self._reset(node, reason, config)
            return f"drained ({reason}); reset hook run"
        return f"drained ({reason})"

    def _reset(self, node: str, reason: str, config: HealthConfig) -> None:
        argv = hook_argv(config.reset_hook, node, reason)
        try:
            res = self._run_hook(argv, config.reset_hook_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as err:
            log.error("health: reset hook for node %s failed: %s (%s)", node, err, argv)
            self.actions.labels("reset_hook_failed").inc()
            return
        if res.returncode != 0:
            log.error(
                "health: reset hook for node %s exited %d: %s",
                node,
                res.returncode,
                (res.stderr or res.stdout or "").strip()[-500:],
            )
            self.actions.labels("reset_hook_failed").inc()
            return
        log.warning("health: reset requested for node %s: %s", node, " ".join(argv))
        self.actions.labels("reset_hook").inc()
