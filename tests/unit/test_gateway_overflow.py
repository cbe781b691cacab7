"""Which requests may overflow, and with what queue budget (gateway/overflow.py)."""

import pytest

from hpcserve.config import ConfigError, ExternalAPIConfig, TenantConfig, parse_config
from hpcserve.gateway.auth import Tenant
from hpcserve.gateway.overflow import ExternalAPI

EXTERNAL = ExternalAPI(
    ExternalAPIConfig(base_url="https://x/v1", models={"m": "their-m"}, queue_budget_s=5.0)
)


@pytest.mark.parametrize(
    ("tenant", "model", "budget"),
    [
        (TenantConfig(name="t", overflow="external"), "m", 5.0),
        (TenantConfig(name="t", overflow="external", queue_budget_s=0.5), "m", 0.5),
        (TenantConfig(name="t", overflow="external"), "other", 0.0),  # not mapped externally
        (TenantConfig(name="t"), "m", 0.0),  # overflow "never": queues here, no budget
        (TenantConfig(name="t", data_resident=True), "m", 0.0),
    ],
)
def test_only_requests_that_may_overflow_carry_a_queue_budget(
    tenant: TenantConfig, model: str, budget: float
) -> None:
    assert EXTERNAL.queue_budget_s(Tenant(tenant.name, tenant), model) == budget


def test_a_queue_budget_for_a_tenant_that_never_overflows_is_refused() -> None:
    config = {
        "gateway": {"tenants": [{"name": "t", "queue_budget_s": 2.0}]},
        "pools": [{"name": "m", "model_path": "/m"}],
    }
    with pytest.raises(ConfigError, match=r"gateway.tenants\[0\].queue_budget_s"):
        parse_config(config)
