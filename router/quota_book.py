"""Per-tenant usage across every gateway: the ledger that makes tenant limits global.

Each gateway admits requests against its own exact usage plus what the others
used, as this book last told it. Gateways send `QuotaReport`s (batched deltas of
requests and tokens, and their absolute in-flight count per tenant) every
`gateway.quota_sync_s`; the router answers each with `QuotaTotals`: the other
gateways' usage over the last minute. Pure bookkeeping with the clock passed in.

Failure mode: a limit can be exceeded by what the other gateways admitted since
their last report (at most one sync interval of their traffic). A gateway that
stops reporting keeps its requests and tokens in the window (they happened) but
its in-flight count is dropped after `stale_after_s`.

A router restart: the book lives in memory only, under an `epoch` drawn at start and
sent with every `QuotaTotals`. A gateway that sees the epoch change sends its whole
window once (`TenantUsage.window`, per second: how long ago, requests, tokens), which
replaces what the new book holds for it, so every gateway's last minute is back within
one sync interval. Usage of a gateway that died before the router came back is lost.
The same epoch is the router's (RouterServer.epoch, in every RouteReply and ReplicaList):
gateways re-declare their requests in flight when it changes (gateway/routing_client.py).
"""

from __future__ import annotations

import math
import uuid

from hpcserve.contracts import protocol as p
from hpcserve.contracts.rate_window import Window


class _GatewayTenant:
    __slots__ = ("in_flight", "seen", "window")

    def __init__(self) -> None:
        self.window = Window()
        self.in_flight = 0
        self.seen = 0.0


class QuotaBook:
    def __init__(self, stale_after_s: float = 5.0, epoch: str = "") -> None:
        self.stale_after_s = stale_after_s
        self.epoch = epoch or uuid.uuid4().hex[:16]
        self._by_tenant: dict[str, dict[str, _GatewayTenant]] = {}

    def report(self, msg: p.QuotaReport, now: float) -> p.QuotaTotals:
        for usage in msg.usage:
            gateways = self._by_tenant.setdefault(usage.tenant, {})
            entry = gateways.get(msg.gateway_id)
            if entry is None:
                entry = gateways[msg.gateway_id] = _GatewayTenant()
            if usage.window is not None:
                entry.window = Window.restored(now, usage.window)
            else:
                entry.window.add(now, usage.requests, usage.tokens)
            entry.in_flight = usage.in_flight
            entry.seen = now
        return p.QuotaTotals(msg.request_id, self.others(msg.gateway_id, now), self.epoch)

    def others(self, gateway_id: str, now: float) -> list[p.TenantTotals]:
        totals = []
        for tenant, gateways in self._by_tenant.items():
            requests = tokens = in_flight = 0
            frees_in = math.inf
            for gid, entry in list(gateways.items()):
                entry.window.expire(now)
                stale = now - entry.seen > self.stale_after_s
                if stale and not entry.window.requests and not entry.window.tokens:
                    del gateways[gid]
                    continue
                if gid == gateway_id:
                    continue
                requests += entry.window.requests
                tokens += entry.window.tokens
                if not stale:
                    in_flight += entry.in_flight
                if entry.window.requests or entry.window.tokens:
                    frees_in = min(frees_in, entry.window.frees_in_s(now))
            if requests or tokens or in_flight:
                totals.append(
                    p.TenantTotals(
                        tenant,
                        requests,
                        tokens,
                        in_flight,
                        0.0 if frees_in == math.inf else round(frees_in, 3),
                    )
                )
        return totals
