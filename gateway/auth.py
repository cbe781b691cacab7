"""API keys: a bearer token maps to a tenant; keys are only ever held as sha256 digests."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec

from hpcserve.config import ApiKey, TenantConfig
from hpcserve.gateway.errors import unauthorized

ADMIN = "admin"


class Tenant(msgspec.Struct, frozen=True):
    """Who a request is from. The name is safe for logs and metric labels; keys never are."""

    name: str
    config: TenantConfig
    admin: bool = False


class KeyRing:
    def __init__(
        self,
        keys: Iterable[ApiKey],
        *,
        tenants: Iterable[TenantConfig] = (),
        admin_keys: Iterable[str] = (),
    ) -> None:
        configs = {t.name: t for t in tenants}
        self._by_digest: dict[str, Tenant] = {}
        for key in keys:
            config = configs.get(key.tenant) or TenantConfig(name=key.tenant)
            self._by_digest[key.sha256] = Tenant(key.tenant, config)
        admin = Tenant(ADMIN, TenantConfig(name=ADMIN), admin=True)
        for digest in admin_keys:
            self._by_digest[digest] = admin

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenants(self) -> list[Tenant]:
        return list({t.name: t for t in self._by_digest.values()}.values())

    def tenant_for(self, authorization: str | None) -> Tenant:
        """The tenant of a request's Authorization header; raises a 401 APIError otherwise."""
        if not authorization:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("Malformed Authorization header: expected 'Bearer <key>'")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        # Looking up the digest, not the key, leaks nothing useful through timing.
        tenant = self._by_digest.get(digest)
        if tenant is None:
            raise unauthorized("Invalid API key")
        return tenant
