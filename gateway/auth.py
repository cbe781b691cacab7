"""API keys: a bearer token maps to a tenant; keys are only ever held as sha256 digests.

A key's id (`key_id`, the first 12 hex digits of its sha256, as the config lists it) names
it in the audit log without revealing it. A refused key is reported to `on_failure` with
the reason ("missing", "malformed", "invalid"): counted and logged by the gateway, the
key itself never.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import msgspec

from hpcserve.config import ApiKey, TenantConfig
from hpcserve.gateway.errors import unauthorized

ADMIN = "admin"


class Tenant(msgspec.Struct, frozen=True):
    """Who a request is from. The name is safe for logs and metric labels; keys never are."""

    name: str
    config: TenantConfig
    admin: bool = False
    key_id: str = ""


KEY_ID_DIGITS = 12


def key_id(sha256_hex: str) -> str:
    return sha256_hex[:KEY_ID_DIGITS]


class KeyRing:
    def __init__(
        self,
        keys: Iterable[ApiKey],
        *,
        tenants: Iterable[TenantConfig] = (),
        admin_keys: Iterable[str] = (),
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        configs = {t.name: t for t in tenants}
        self._by_digest: dict[str, Tenant] = {}
        for key in keys:
            config = configs.get(key.tenant) or TenantConfig(name=key.tenant)
            self._by_digest[key.sha256] = Tenant(key.tenant, config, key_id=key_id(key.sha256))
        admin = TenantConfig(name=ADMIN)
        for digest in admin_keys:
            self._by_digest[digest] = Tenant(ADMIN, admin, admin=True, key_id=key_id(digest))
        self.on_failure = on_failure

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenants(self) -> list[Tenant]:
        return list({t.name: t for t in self._by_digest.values()}.values())

    def tenant_for(self, authorization: str | None) -> Tenant:
        """The tenant of a request's Authorization header; raises a 401 APIError otherwise."""
        if not authorization:
            self._failed("missing")
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            self._failed("malformed")
            raise unauthorized("Malformed Authorization header: expected 'Bearer <key>'")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        # Looking up the digest, not the key, leaks nothing useful through timing.
        tenant = self._by_digest.get(digest)
        if tenant is None:
            self._failed("invalid")
            raise unauthorized("Invalid API key")
        return tenant

    def peek(self, authorization: str | None) -> Tenant | None:
        """The tenant of a header, or None; nothing is counted (for the audit log)."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._by_digest.get(hashlib.sha256(token.strip().encode()).hexdigest())

    def _failed(self, reason: str) -> None:
        if self.on_failure is not None:
            self.on_failure(reason)
