"""API keys: a bearer token maps to a tenant; keys are only ever held as sha256 digests."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from hpcserve.config import ApiKey
from hpcserve.gateway.errors import unauthorized


class KeyRing:
    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self._tenant_by_digest = {k.sha256: k.tenant for k in keys}

    def __len__(self) -> int:
        return len(self._tenant_by_digest)

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of a request's Authorization header; raises a 401 APIError otherwise."""
        if not authorization:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("Malformed Authorization header: expected 'Bearer <key>'")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        # Looking up the digest, not the key, leaks nothing useful through timing.
        tenant = self._tenant_by_digest.get(digest)
        if tenant is None:
            raise unauthorized("Invalid API key")
        return tenant
