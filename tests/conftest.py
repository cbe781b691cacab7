"""Shared fixtures: a real router on free loopback ports, run in a thread."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from hpcserve.router.server import RouterServer
from tests.routers import loopback_router_config, running_router


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A CLI run in-process calls setup_logging, whose handler writes to the stderr of that
    test's capture; the next test would log into the closed stream. Put the root logger back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture
def router() -> Iterator[RouterServer]:
    with running_router(loopback_router_config()) as server:
        yield server
