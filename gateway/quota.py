"""Tenant limits at admission: requests/min, tokens/min and concurrent requests.

A gateway admits against its own exact usage plus the other gateways' usage as
the router's quota book last reported it (router/quota_book.py); `report()` and
`apply()` are the two halves of that sync, run every `gateway.quota_sync_s`.
Tokens are charged after the fact, from the engine's usage, so a tenant under its
token limit may finish one request that takes it over; the next is refused.

When the router has not answered for `stale_after_s`, the others' usage is
ignored and each gateway enforces the limits on its own traffic only (fail open,
logged once): a router outage must not stop every tenant.

The router's book is in memory; its epoch comes with every answer. When the epoch
changes (the router restarted), the next report carries this gateway's whole window
instead of deltas, and the new book takes it as this gateway's usage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from hpcserve.contracts import protocol as p
from hpcserve.contracts.rate_window import Window
from hpcserve.gateway.auth import Tenant
from hpcserve.gateway.errors import APIError
from hpcserve.gateway.routing_client import RouterUnavailable, Routing


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


log = logging.getLogger(__name__)


def has_limits(tenant: Tenant) -> bool:
    c = tenant.config
    return bool(c.requests_per_min or c.tokens_per_min or c.max_concurrent)


class _Ledger:
    __slots__ = ("dirty", "in_flight", "requests", "tokens", "window")

    def __init__(self) -> None:
        self.window = Window()
        self.in_flight = 0
        self.requests = 0  # not yet reported
        self.tokens = 0
        self.dirty = False


class QuotaExceeded(APIError):
    def __init__(self, tenant: str, limit: str, value: int, retry_after_s: float) -> None:
        super().__init__(
            429,
            f"Tenant '{tenant}' is over its {limit} limit of {value}; retry after "
            f"{math.ceil(retry_after_s)}s",
            type="rate_limit_exceeded",
            code="rate_limit_exceeded",
            retry_after_s=max(1, math.ceil(retry_after_s)),
        )
        self.limit = limit


class QuotaGate:
    def __init__(
        self,
        gateway_id: str,
        *,
        stale_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway_id = gateway_id
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._ledgers: dict[str, _Ledger] = {}
        self._others: dict[str, p.TenantTotals] = {}
        self._others_at = -math.inf
        self._in_transit: list[p.TenantUsage] | None = None
        self._warned_stale = False
        self._epoch = ""  # the router quota book's, as last answered
        self._resync = False  # the next report sends whole windows

    def _ledger(self, tenant: str) -> _Ledger:
        ledger = self._ledgers.get(tenant)
        if ledger is None:
            ledger = self._ledgers[tenant] = _Ledger()
        return ledger

    def admit(self, tenant: Tenant) -> None:
        """Count a request in, or raise QuotaExceeded (429) without counting it."""
        c = tenant.config
        now = self._clock()
        ledger = self._ledger(tenant.name)
        others = self._fresh_others(tenant.name, now)
        if c.max_concurrent:
            running = ledger.in_flight + (others.in_flight if others else 0)
            if running >= c.max_concurrent:
                raise QuotaExceeded(tenant.name, "max_concurrent", c.max_concurrent, 1)
        if c.requests_per_min or c.tokens_per_min:
            ledger.window.expire(now)
            for limit, value, own, theirs in (
                ("requests_per_min", c.requests_per_min, ledger.window.requests, "requests"),
                ("tokens_per_min", c.tokens_per_min, ledger.window.tokens, "tokens"),
            ):
                used = own + (getattr(others, theirs) if others else 0)
                if value and used >= value:
                    raise QuotaExceeded(tenant.name, limit, value, self._frees_in(ledger, others))
        ledger.window.add(now, 1, 0)
        ledger.requests += 1
        ledger.in_flight += 1
        ledger.dirty = True

    def finish(self, tenant: Tenant, tokens: int) -> None:
        ledger = self._ledger(tenant.name)
        ledger.in_flight -= 1
        if tokens:
            ledger.window.add(self._clock(), 0, tokens)
            ledger.tokens += tokens
        ledger.dirty = True

    def charge_tokens(self, key: str, tokens: int) -> None:
        """Count tokens used outside admit/finish under `key` (the Batch API's, as
        "batch:<tenant>", gateway/batch/limiter.py); synced with the router like a tenant."""
        ledger = self._ledger(key)
        ledger.window.add(self._clock(), 0, tokens)
        ledger.tokens += tokens
        ledger.dirty = True

    def tokens_used(self, key: str) -> tuple[int, float]:
        """Tokens of `key` in the last minute on every gateway (the others' as last synced),
        and the seconds until some of them leave the window."""
        now = self._clock()
        ledger = self._ledger(key)
        ledger.window.expire(now)
        others = self._fresh_others(key, now)
        used = ledger.window.tokens + (others.tokens if others else 0)
        return used, self._frees_in(ledger, others)

    def refund(self, tenant: Tenant) -> None:
        """Undo an admit whose request turned out to be bad input (e.g. an unknown model)."""
        ledger = self._ledger(tenant.name)
        ledger.in_flight -= 1
        ledger.window.add(self._clock(), -1, 0)
        ledger.requests -= 1
        ledger.dirty = True

    def _fresh_others(self, tenant: str, now: float) -> p.TenantTotals | None:
        if now - self._others_at > self.stale_after_s:
            if self._others_at > -math.inf and not self._warned_stale:
                log.warning(
                    "quota totals from the router are older than %.0fs: enforcing tenant "
                    "limits on this gateway's traffic only",
                    self.stale_after_s,
                )
                self._warned_stale = True
            return None
        return self._others.get(tenant)

    def _frees_in(self, ledger: _Ledger, others: p.TenantTotals | None) -> float:
        now = self._clock()
        waits = [w for w in (ledger.window.frees_in_s(now),) if w > 0]
        if others is not None and others.frees_in_s > 0:
            waits.append(others.frees_in_s)
        return min(waits) if waits else 1.0

    def report(self, *, keepalive: bool = False) -> list[p.TenantUsage] | None:
        """The usage to send the router now (None if nothing changed and not keepalive)."""
        if self._resync:
            return self._whole_windows()
        usage = []
        for name, ledger in self._ledgers.items():
            if ledger.dirty or (keepalive and ledger.in_flight):
                usage.append(p.TenantUsage(name, ledger.requests, ledger.tokens, ledger.in_flight))
                ledger.requests = ledger.tokens = 0
                ledger.dirty = False
        if not usage and not keepalive:
            return None
        self._in_transit = usage
        return usage

    def _whole_windows(self) -> list[p.TenantUsage]:
        now = self._clock()
        usage = []
        for name, ledger in self._ledgers.items():
            window = ledger.window.ages(now)
            if window or ledger.in_flight:
                usage.append(p.TenantUsage(name, 0, 0, ledger.in_flight, window=window))
            ledger.requests = ledger.tokens = 0  # inside the window sent
            ledger.dirty = False
        self._resync = False
        self._in_transit = usage
        return usage

    def apply(self, totals: p.QuotaTotals) -> None:
        if totals.epoch != self._epoch:
            if self._epoch:
                log.info("router quota book is new (restart): re-sending this gateway's usage")
            self._epoch = totals.epoch
            self._resync = True
        self._others = {t.tenant: t for t in totals.tenants}
        self._others_at = self._clock()
        self._in_transit = None
        if self._warned_stale:
            log.info("quota totals from the router are current again")
            self._warned_stale = False

    def unsent(self) -> None:
        """The last report got no answer: its deltas go out again with the next one."""
        usage_sent, self._in_transit = self._in_transit, None
        if any(usage.window is not None for usage in usage_sent or ()):
            self._resync = True  # the whole windows go again (they hold the deltas)
            return
        for usage in usage_sent or ():
            ledger = self._ledger(usage.tenant)
            ledger.requests += usage.requests
            ledger.tokens += usage.tokens
            ledger.dirty = True


async def keep_quota_synced(
    gate: QuotaGate, routing: Routing, sender_id: str, interval_s: float, failures: _Counter
) -> None:
    """Every `interval_s`, this process's usage to the router's quota book and every other
    process's totals back into `gate` (a gateway's, or the batch runner's); runs until
    cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        # Also when this process is idle: the others' usage must stay current here.
        usage = gate.report(keepalive=True) or []
        try:
            totals = await routing.sync_quota(sender_id, usage)
        except RouterUnavailable:
            failures.inc()
            gate.unsent()
            continue
        except Exception:  # the sync must outlive a bad reply; limits go local meanwhile
            log.exception("quota sync failed")
            failures.inc()
            gate.unsent()
            continue
        gate.apply(totals)
