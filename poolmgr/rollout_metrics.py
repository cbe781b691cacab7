"""Where the rollout loop reads its numbers: every gateway's own /metrics.

Read from the gateways rather than through a Prometheus server: the pool manager needs no
Prometheus (a site may run none), and it judges on counters as they are at the check, not
as of the last scrape (a Prometheus scrape interval of 15-60 s would delay a rollback by as
much). It costs one HTTP GET per gateway per check (`rollout.check_s`), with the metrics
token that the control node holds anyway (gateway.metrics_token_file). The counters are
kept per gateway, so a gateway that restarts (its counters back to 0) is seen as such.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Collection

from prometheus_client.parser import text_string_to_metric_families

from hpcserve.config import PlatformConfig
from hpcserve.poolmgr.rollout import FAMILIES, counter_key


class MetricsUnavailable(RuntimeError):
    pass


def gateway_urls(config: PlatformConfig) -> list[str]:
    """rollout.gateways, else this config's own gateway."""
    if config.rollout.gateways:
        return [url.rstrip("/") for url in config.rollout.gateways]
    gw = config.gateway
    host = "127.0.0.1" if gw.host in ("", "0.0.0.0", "::") else gw.host
    scheme = "https" if gw.tls_cert else "http"
    return [f"{scheme}://{host}:{gw.port}"]


def parse(text: str, source: str, models: Collection[str]) -> dict[str, dict[str, float]]:
    """Model asked for -> counters (poolmgr/rollout.py's keys) of one gateway's /metrics,
    summed over adapters; only the models in `models`."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = FAMILIES.get(sample.name)
            model = sample.labels.get("model", "")
            if name is None or model not in models:
                continue
            key = counter_key(source, name, sample.labels.get("version", ""),
                              sample.labels.get("le", ""))  # fmt: skip
            counters = found.setdefault(model, {})
            counters[key] = counters.get(key, 0.0) + sample.value
    return found


def read_gateways(
    urls: list[str], token: str, models: Collection[str], *, timeout_s: float, ca_file: str = ""
) -> dict[str, dict[str, float]]:
    """Every gateway's counters for `models`; MetricsUnavailable naming the gateway when one
    does not answer (a window missing a gateway would judge on part of the traffic)."""
    context = ssl.create_default_context(cafile=ca_file or None)
    merged: dict[str, dict[str, float]] = {}
    for url in urls:
        request = urllib.request.Request(
            url + "/metrics", headers={"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:
                text = answer.read().decode()
        except (urllib.error.URLError, OSError, UnicodeDecodeError) as err:
            raise MetricsUnavailable(f"{url}/metrics: {err}") from None
        for model, counters in parse(text, url, models).items():
            merged.setdefault(model, {}).update(counters)
    return merged
