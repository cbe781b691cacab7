"""The pool manager's rollout loop: every `rollout.check_s`, read the gateways' counters,
decide each active rollout (poolmgr/rollout.py) and apply the change to its alias in the
model registry, which the router re-reads (router/aliases.py, within alias_refresh_s).

It runs on a thread of its own beside the reconcile loop (poolmgr/manager.py), so a slow
Slurm call never delays a rollback, nor a gateway that does not answer a submission. A
check runs under the rollout file's lock (poolmgr/rollout_state.py), registry write
included, so `hpcserve rollout pause|abort` and the loop never cross. An alias changed by
hand during a rollout (`hpcserve models alias|promote`) aborts the rollout and is left as
the admin set it. One log line per change; metrics: hpcserve_rollout_*.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from hpcserve.config import PlatformConfig
from hpcserve.contracts.engine_token import EngineTokenError, read_token
from hpcserve.modelcache.registry import Registry, RegistryError
from hpcserve.poolmgr import rollout as ro
from hpcserve.poolmgr.rollout_metrics import MetricsUnavailable, gateway_urls, read_gateways
from hpcserve.poolmgr.rollout_state import RolloutBook, RolloutStateError

log = logging.getLogger(__name__)

ReadCounters = Callable[[Collection[str]], dict[str, dict[str, float]]]


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.step = Gauge(
            "hpcserve_rollout_step",
            "The step a rollout is in (1 is the first; 0 before the first)",
            ["alias"],
            registry=registry,
        )
        self.share = Gauge(
            "hpcserve_rollout_share_percent",
            "The share of an alias's requests a rollout routes to the new version",
            ["alias"],
            registry=registry,
        )
        self.state = Gauge(
            "hpcserve_rollout_state",
            "1 for the state a rollout is in (pending, holding, paused, completed, "
            "rolled_back, aborted)",
            ["alias", "state"],
            registry=registry,
        )
        self.rollbacks = Counter(
            "hpcserve_rollout_rollbacks_total",
            "Rollouts rolled back because the new version left its bounds",
            ["alias"],
            registry=registry,
        )
        self.metric_failures = Counter(
            "hpcserve_rollout_metrics_failures_total",
            "Checks that could not read every gateway's /metrics (nothing was judged)",
            registry=registry,
        )

    def show(self, r: ro.Rollout) -> None:
        self.step.labels(r.alias).set(r.step + 1)
        self.share.labels(r.alias).set(r.share)
        for state in ro.STATES:
            self.state.labels(r.alias, state).set(1 if state == r.state else 0)


class RolloutController:
    def __init__(
        self,
        config: PlatformConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        read_counters: ReadCounters | None = None,
    ) -> None:
        """read_counters: model names -> their counters (default: every gateway's
        /metrics, poolmgr/rollout_metrics.py)."""
        self.config = config
        self.book = RolloutBook(Path(config.state_dir))
        self.metrics = RolloutMetrics(metrics_registry or CollectorRegistry())
        self._clock = clock
        self._read_counters = read_counters or self._read_gateways
        self._unavailable = ""  # the last reason the gateways could not be read

    def _read_gateways(self, models: Collection[str]) -> dict[str, dict[str, float]]:
        try:
            token = read_token(self.config.metrics_token_path())
        except (OSError, EngineTokenError) as err:
            raise MetricsUnavailable(f"cannot read the metrics token: {err}") from None
        return read_gateways(
            gateway_urls(self.config),
            token,
            models,
            timeout_s=self.config.rollout.metrics_timeout_s,
            ca_file=self.config.gateway.tls_cert if not self.config.rollout.gateways else "",
        )

    def check(self) -> None:
        """One pass over the active rollouts."""
        try:
            active = [r.alias for r in self.book.read().values() if r.active]
        except RolloutStateError as err:
            log.error("rollouts: %s", err)
            return
        if not active:
            return
        counters: dict[str, dict[str, float]] | None
        try:
            counters = self._read_counters(active)
            if self._unavailable:
                log.info("rollouts: the gateways' metrics answer again")
                self._unavailable = ""
        except MetricsUnavailable as err:
            counters = None
            self.metrics.metric_failures.inc()
            if str(err) != self._unavailable:
                log.warning("rollouts: nothing judged until the gateways answer: %s", err)
                self._unavailable = str(err)
        now = self._clock()
        with self.book.change() as rollouts, Registry(Path(self.config.registry_path())) as reg:
            for alias, r in list(rollouts.items()):
                if r.active:
                    seen = None if counters is None else counters.get(alias, {})
                    rollouts[alias] = self._check_one(r, seen, now, reg)
                self.metrics.show(rollouts[alias])

    def _check_one(
        self, r: ro.Rollout, counters: dict[str, float] | None, now: float, reg: Registry
    ) -> ro.Rollout:
        outside = _changed_by_hand(r, reg)
        if outside:
            done = ro.abort(r, now, f"alias changed outside the rollout: {outside}")
            log.warning("%s", ro.describe(done))
            return done
        decision = ro.decide(r, counters, now, self.config.rollout)
        if decision.change is not None:
            try:
                apply(reg, decision.rollout, decision.change.share)
            except RegistryError as err:
                why = f"the registry refused share {decision.change.share}: {err}"
                done = ro.abort(r, now, why)
                log.error("%s", ro.describe(done))
                return done
        if decision.log:
            log.info("%s", decision.log)
        if decision.rollout.state == ro.ROLLED_BACK and r.state != ro.ROLLED_BACK:
            self.metrics.rollbacks.labels(r.alias).inc()
        return decision.rollout

    def run(self, stop: threading.Event) -> None:
        """Check every rollout.check_s until `stop` is set; a failed check is logged."""
        while not stop.is_set():
            try:
                self.check()
            except Exception:  # a loop beside the reconcile loop: it must not die silently
                log.exception("rollout check failed; again in %gs", self.config.rollout.check_s)
            stop.wait(self.config.rollout.check_s)

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name="rollouts", daemon=True)
        thread.start()
        return thread


def apply(reg: Registry, r: ro.Rollout, share: int) -> None:
    """Route `share`% of the rollout's alias to its new version (0: drop it as the canary,
    if it still is one), through the registry's gated promote: the version's gate is checked
    again (a failed evaluation since the start stops the rollout), a forced rollout passes
    its reason on, and every move leaves a line in the registry's audit."""
    if share == 0 and reg.alias(r.alias).canary != r.ref:
        return
    reg.promote_gated(r.alias, r.ref, share, force_reason=r.forced, actor="rollout")


def _changed_by_hand(r: ro.Rollout, reg: Registry) -> str:
    """How the alias differs from what the rollout set ("" if it does not)."""
    try:
        alias = reg.alias(r.alias)
    except RegistryError as err:
        return str(err)
    expected: tuple[str, str | None, int] = (r.stable, None, 0)
    if r.state != ro.PENDING and r.step >= 0:
        expected = (r.stable, r.ref, r.share)
    now = (alias.target, alias.canary, alias.canary_percent)
    if now == expected:
        return ""
    canary = f", canary {alias.canary} at {alias.canary_percent}%" if alias.canary else ""
    return f"it routes to {alias.target}{canary}"
