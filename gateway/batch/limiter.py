"""A tenant's batch tokens per minute (`batch_tokens_per_min`), across every gateway.

The tokens are counted in the gateway's `QuotaGate` under the key `batch:<tenant>` (a
name no tenant can have: tenant names allow no colon), so they travel to the router's
quota book and back with the other tenant limits, a router restart included
(router/quota_book.py): a gateway that takes over the batch runner from one that died
sees what that one used in the last minute. A request may start while the tenant's batch
tokens in the last minute, on all gateways, are below the limit; it is charged its real
usage when it ends, so one request can take the tenant over, and the next waits until
enough usage leaves the window. Zero means unlimited.

Failure mode: as for the other limits, the others' usage is as fresh as the last quota
sync (`gateway.quota_sync_s`), and with the router away each gateway counts its own only.
"""

from __future__ import annotations

import asyncio

from hpcserve.gateway.quota import QuotaGate

MAX_WAIT_S = 1.0  # re-check at least this often: other gateways' usage leaves too


def quota_key(tenant: str) -> str:
    return f"batch:{tenant}"


class BatchTokens:
    def __init__(self, gate: QuotaGate, per_min: dict[str, int]) -> None:
        self.gate = gate
        self.per_min = per_min  # by tenant; a tenant not listed is unlimited

    def wait_s(self, tenant: str) -> float:
        """Seconds to wait before the tenant's next batch request may start (0: now)."""
        limit = self.per_min.get(tenant, 0)
        if not limit:
            return 0.0
        used, frees_in_s = self.gate.tokens_used(quota_key(tenant))
        return 0.0 if used < limit else min(max(frees_in_s, 0.01), MAX_WAIT_S)

    def charge(self, tenant: str, tokens: int) -> None:
        if self.per_min.get(tenant, 0) and tokens:
            self.gate.charge_tokens(quota_key(tenant), tokens)

    async def admit(self, tenant: str) -> None:
        while (delay := self.wait_s(tenant)) > 0:
            await asyncio.sleep(delay)
