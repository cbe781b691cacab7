"""One log format for every hpcserve process: a line per state change, to stderr."""

from __future__ import annotations

import logging
import os


def setup_logging(component: str, level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("HPCSERVE_LOG_LEVEL", "INFO")).upper(),
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        force=True,
    )
