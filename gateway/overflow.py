"""Overflow: an external OpenAI-compatible API for tenants that allow it.

Used when no replica can take a request within the tenant's queue budget (the router
answered over_queue_budget, router/queue_wait.py), or there is no replica at all (no
replica, or the router did not answer), and the tenant's overflow is "external" and it
is not data-resident (the config refuses data_resident with overflow "external"; this
checks again). Only such requests carry a budget to the router: everyone else's requests
queue at a replica as before, and get 503 only when there is no replica. The request
body is re-encoded with the external model name; the client's key is never sent on: the
external API gets the key from `gateway.overflow.api_key_env`.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from hpcserve.config import ExternalAPIConfig
from hpcserve.gateway.auth import Tenant

_dict = msgspec.json.Decoder(dict[str, Any])


class ExternalAPI:
    def __init__(self, config: ExternalAPIConfig) -> None:
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def takes(self, tenant: Tenant, model: str) -> bool:
        c = tenant.config
        return c.overflow == "external" and not c.data_resident and model in self.config.models

    def queue_budget_s(self, tenant: Tenant, model: str) -> float:
        """The Route's queue budget: 0 (none) unless the request may overflow."""
        if not self.takes(tenant, model):
            return 0.0
        return tenant.config.queue_budget_s or self.config.queue_budget_s

    def url(self, endpoint: str) -> str:
        # base_url ends in /v1, as the openai SDK's does; endpoints here start with /v1.
        return self.base_url + endpoint.removeprefix("/v1")

    def body(self, body: bytes, model: str) -> bytes:
        payload = _dict.decode(body)
        payload["model"] = self.config.models[model]
        return msgspec.json.encode(payload)
