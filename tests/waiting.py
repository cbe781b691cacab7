"""Waiting for a condition in a test, asynchronously (the synchronous twin for Slurm states is
tests/integration/slurm_helpers.wait_for). The deadline is generous: a CI machine may pause
the test process for seconds, and a wait ends as soon as the condition holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(what: str, probe: Callable[[], bool], timeout: float = 60.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not probe():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None
