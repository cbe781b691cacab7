"""Waiting for a benchmark's local services to answer HTTP."""

from __future__ import annotations

import time
import urllib.error
import urllib.request


def wait_http(url: str, timeout_s: float = 30) -> None:
    """Until `url` answers at all (any status counts); RuntimeError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except Exception:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")
