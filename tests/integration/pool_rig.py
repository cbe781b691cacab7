"""The setup of a pool-manager test on the real two-node Slurm cluster: the `rig` fixture
of tests/integration/conftest.py (as `tests/services.stack_config` is that of a whole
`hpcserve up` stack)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, PlatformConfig, hash_api_key
from hpcserve.contracts.engine_token import read_token
from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.contracts.router_client import list_replicas
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.localslurm import LocalSlurm
from hpcserve.router.server import RouterServer
from hpcserve.slurm.client import SlurmCLI
from tests.integration.slurm_helpers import cluster_config, wait_for

T = TypeVar("T")


def poll_until(
    poll: Callable[[], object], what: str, condition: Callable[[], T | None], timeout: float = 120
) -> T:
    """wait_for `condition`, with one `poll` (a PoolManager's poll_once, say) before each
    look: the pool manager's loop, in step with what the test waits for."""

    def step() -> T | None:
        poll()
        return condition()

    return wait_for(what, step, timeout=timeout)


@dataclass
class PoolRig:
    """What a pool-manager test works with: the module's cluster, the test's Slurm client,
    router and state dir, and the pool manager's log at INFO in caplog."""

    cluster: LocalSlurm
    slurm: SlurmCLI
    router: RouterServer
    state_dir: Path
    caplog: pytest.LogCaptureFixture

    def __post_init__(self) -> None:
        self.caplog.set_level(logging.INFO, "hpcserve.poolmgr")

    def config(
        self, prefix: str, pool: dict[str, Any], **sections: dict[str, Any]
    ) -> PlatformConfig:
        """`cluster_config` on this cluster, router and state dir."""
        return cluster_config(self.cluster, self.router, self.state_dir, prefix, pool, **sections)

    def serving(self, pool: str) -> list[ReplicaInfo]:
        """The router's replicas of `pool`."""
        return [r for r in list_replicas(self.router.config.routing_bind) if r.pool == pool]

    def history(self) -> str:
        """What was logged so far, a line a record."""
        return "\n".join(r.getMessage() for r in self.caplog.records)

    @contextmanager
    def openai_client(
        self, config: PlatformConfig, key: str, models: Collection[str]
    ) -> Iterator[openai.OpenAI]:
        """The official openai client of tenant "t" (API key `key`) on an in-process gateway
        in front of the router, for the pools `models` of `config`."""
        gateway = Gateway(
            GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(key))]),
            routing_endpoint=self.router.config.routing_bind,
            configured_models=set(models),
            engine_token=read_token(config.engine_token_path()),
        )
        with TestClient(build_app(gateway)) as http:
            yield openai.OpenAI(
                base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
            )
