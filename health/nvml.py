"""Which NVML a check talks to: nvidia-ml-py's `pynvml`, or the fake when asked for.

The checks call the pynvml functions by name on the object returned here, so the real
module and `FakeNvml` are interchangeable. The fake is chosen only explicitly (a path in
health.fake_nvml or $HPCSERVE_FAKE_NVML); a machine without NVML gets NvmlUnavailable,
never the fake.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FAKE_ENV = "HPCSERVE_FAKE_NVML"


class NvmlUnavailable(RuntimeError):
    pass


def fake_state_path(configured: str, env: Mapping[str, str] | None = None, node: str = "") -> str:
    """The fake's state file, "" for the real NVML; "{node}" becomes the node name."""
    env = os.environ if env is None else env
    path = env.get(FAKE_ENV) or configured
    return path.replace("{node}", node) if path else ""


def open_nvml(fake_state: str = "") -> Any:
    """An initialised NVML: pynvml, or FakeNvml(fake_state) when a state file is given."""
    import pynvml

    lib: Any
    if fake_state:
        from hpcserve.health.fake_nvml import FakeNvml

        lib = FakeNvml(Path(fake_state))
        what = f"the fake NVML ({fake_state})"
    else:
        lib = pynvml
        what = "NVML"
    try:
        lib.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"cannot initialise {what}: {err}") from None
    return lib
