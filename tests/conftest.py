"""Shared fixtures: a real router on free loopback ports, run in a thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from hpcserve.config import RouterConfig
from hpcserve.router.server import RouterServer
from tests.ports import free_port


@pytest.fixture
def router() -> Iterator[RouterServer]:
    config = RouterConfig(
        registry_bind=f"tcp://127.0.0.1:{free_port()}",
        routing_bind=f"tcp://127.0.0.1:{free_port()}",
        lease_s=1.0,
        heartbeat_s=0.25,
        metrics_port=0,
    )
    server = RouterServer(config)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, name="router", daemon=True)
    thread.start()
    assert server.ready.wait(5)
    yield server
    server.stop()
    thread.join(5)
    assert not thread.is_alive()
