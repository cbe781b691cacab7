"""A gateway's RouteHints for the configured pools: which models' prompts are hashed, with
which tokenizer and block size (the pool config and the model registry say), each with a
prompt cache of `gateway.prompt_cache_mb` (contracts/prompt_cache.py) and its metrics; and
`body_plan` / `body_hints`, the hints of a request body as the gateway and the batch runner
compute them."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hpcserve.config import PlatformConfig
from hpcserve.contracts.engine_args import engine_block_size
from hpcserve.contracts.prompt_tokens import HintsPlan, PromptTokenizer, RouteHints, hash_stride
from hpcserve.gateway.json_scan import message_spans

log = logging.getLogger(__name__)


def route_hints_for(config: PlatformConfig) -> RouteHints | None:
    """A gateway's RouteHints for the configured pools (None: the policy ignores prefixes).

    A pool is covered when its model directory (pools[].model_path) holds tokenizer.json
    and its engine's block size is known; others are routed on load alone.
    """
    if config.router.routing.policy != "kv-aware":
        return None
    hints = RouteHints()
    cache_bytes = config.gateway.prompt_cache_mb << 20
    for pool in config.pools:
        model_path, engine_args = pool.model_path, list(pool.engine_args)
        try:
            if not model_path and pool.model_ref:
                model_path, more_args = _registered_source(config, pool.model_ref)
                engine_args = [*more_args, *engine_args]
            size = engine_block_size(pool.engine, engine_args)
            if not size or not model_path:
                continue
            tokenizer = PromptTokenizer.from_dir(model_path)
        except Exception as err:  # a bad tokenizer must not stop the gateway
            log.warning("pool %s: no prefix-aware routing (tokenizer: %s)", pool.name, err)
            continue
        gateway = config.gateway
        hints.add_model(
            pool.model,
            tokenizer,
            size,
            cache_bytes,
            gateway.prompt_defer_chars,
            hash_stride(gateway.prefix_hash_tokens, size),
        )
        log.info("pool %s: prefix-aware routing with %d-token blocks", pool.name, size)
        if pool.max_loras:
            # A request naming an adapter is hashed from the adapter's chain seed, as the
            # router hashes BlockStored events that carry its lora_name.
            bases = {pool.model, pool.model_ref.partition("@")[0]} - {""}
            for adapter in [*pool.lora_adapters, *registry_adapters(config, bases)]:
                hints.add_adapter(adapter, pool.model)
    return hints


def body_plan(
    hints: RouteHints, model: str, body: bytes, headers: Mapping[str, str], salt: str = ""
) -> HintsPlan:
    """The hints plan of a request body: a chat's messages read from their bytes
    (message_spans, `RouteHints.plan_body`), so that the interactive requests and the batch
    runner's share the prompt cache's entries."""
    return hints.plan_body(model, body, message_spans(body), headers, salt)


def body_hints(
    hints: RouteHints, model: str, body: bytes, headers: Mapping[str, str], salt: str = ""
) -> dict[str, Any]:
    """`body_plan` run whole, all of its work done here (a caller on a thread)."""
    return body_plan(hints, model, body, headers, salt).run()


def registry_adapters(config: PlatformConfig, bases: set[str]) -> list[str]:
    """The model registry's LoRA adapters for any of `bases` (none without a registry)."""
    path = Path(config.registry_path())
    if not path.exists():
        return []
    from hpcserve.modelcache.registry import Registry

    try:
        with Registry(path) as registry:
            return [a.name for a in registry.adapters() if a.base_model in bases]
    except Exception as err:  # prefix hints are an optimisation: never stop the gateway
        log.warning("no prefix-aware routing for adapters (registry %s: %s)", path, err)
        return []


def _registered_source(config: PlatformConfig, ref: str) -> tuple[str, list[str]]:
    """A registry ref's source directory (on the shared filesystem) and engine arguments."""
    from hpcserve.modelcache.registry import Registry

    registry = Registry(Path(config.registry_path()))
    try:
        version = registry.version(ref)
    finally:
        registry.close()
    return version.source, list(version.engine_args)


class PromptCacheMetrics(Collector):
    """The prompt caches' counts, read at scrape time (nothing on the request path)."""

    def __init__(self, hints: RouteHints) -> None:
        self.hints = hints

    def collect(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "hpcserve_gateway_prompt_cache_tokens",
            "Prompt tokens of prefix-hinted requests by model: hit (their rendering, tokens "
            "and block hashes came from the prompt cache), miss (rendered and tokenized) or "
            "deferred (a new last message's, estimated, not tokenized: "
            "gateway.prompt_defer_chars); the hit rate is hit / (hit + miss)",
            labels=["model", "result"],
        )
        size = GaugeMetricFamily(
            "hpcserve_gateway_prompt_cache_bytes",
            "Memory the prompt cache holds, about (bounded by gateway.prompt_cache_mb)",
            labels=["model"],
        )
        evicted = CounterMetricFamily(
            "hpcserve_gateway_prompt_cache_evictions",
            "Leading prompt parts dropped from the prompt cache to stay within its bound",
            labels=["model"],
        )
        mismatches = CounterMetricFamily(
            "hpcserve_gateway_prompt_cache_mismatches",
            "Sampled prompts whose rendering message by message differed from rendering them "
            "whole (the model's prompts are rendered whole after the first)",
            labels=["model"],
        )
        by_message = GaugeMetricFamily(
            "hpcserve_gateway_prompt_cache_by_message",
            "1 when the model's chat prompts are rendered and cached message by message, 0 "
            "when whole (its template does not render messages independently)",
            labels=["model"],
        )
        for model, cache, mismatch_count, chunked in self.hints.cache_stats():
            tokens.add_metric([model, "hit"], cache.hit_tokens)
            tokens.add_metric([model, "miss"], cache.miss_tokens)
            tokens.add_metric([model, "deferred"], cache.deferred_tokens)
            size.add_metric([model], cache.bytes)
            evicted.add_metric([model], cache.evicted)
            mismatches.add_metric([model], mismatch_count)
            by_message.add_metric([model], 1 if chunked else 0)
        yield from (tokens, size, evicted, mismatches, by_message)


def register_cache_metrics(registry: CollectorRegistry, hints: RouteHints | None) -> None:
    if hints is not None:
        registry.register(PromptCacheMetrics(hints))
