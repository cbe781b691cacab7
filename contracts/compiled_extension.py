"""Loading one of hpcserve's C extensions (contracts/_blockhash.c, gateway/_json_scan.c):
an error that names the fix when it was never built, or built from an older source (an
editable install does not rebuild an extension by itself)."""

from __future__ import annotations

import importlib
from types import ModuleType


def load_extension(module: str, source: str, api_version: int) -> ModuleType:
    """The compiled `module` (built from `source`), whose API_VERSION must be `api_version`;
    ImportError saying to run `pip install -e .` otherwise."""
    try:
        extension = importlib.import_module(module)
    except ImportError as exc:  # a source tree that was never installed
        raise ImportError(
            f"{module} ({source}) is not built: run `pip install -e .` in the hpcserve "
            "checkout (it needs gcc and the Python headers)"
        ) from exc
    built = getattr(extension, "API_VERSION", None)
    if built != api_version:
        raise ImportError(
            f"{module} is a stale build (API {built}, this code needs {api_version}): run "
            "`pip install -e .` again to rebuild it"
        )
    return extension
