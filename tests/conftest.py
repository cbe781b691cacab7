"""Shared fixtures: a real router on free loopback ports, run in a thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hpcserve.router.server import RouterServer
from tests.routers import loopback_router_config, running_router


@pytest.fixture
def router() -> Iterator[RouterServer]:
    with running_router(loopback_router_config()) as server:
        yield server
