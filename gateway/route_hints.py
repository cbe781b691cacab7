"""A gateway's RouteHints for the configured pools: which models' prompts are hashed, with
which tokenizer and block size (the pool config and the model registry say)."""

from __future__ import annotations

import logging
from pathlib import Path

from hpcserve.config import PlatformConfig
from hpcserve.contracts.engine_args import engine_block_size
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints

log = logging.getLogger(__name__)


def route_hints_for(config: PlatformConfig) -> RouteHints | None:
    """A gateway's RouteHints for the configured pools (None: the policy ignores prefixes).

    A pool is covered when its model directory (pools[].model_path) holds tokenizer.json
    and its engine's block size is known; others are routed on load alone.
    """
    if config.router.routing.policy != "kv-aware":
        return None
    hints = RouteHints()
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
        hints.add_model(pool.model, tokenizer, size)
        log.info("pool %s: prefix-aware routing with %d-token blocks", pool.name, size)
        if pool.max_loras:
            # A request naming an adapter is hashed from the adapter's chain seed, as the
            # router hashes BlockStored events that carry its lora_name.
            bases = {pool.model, pool.model_ref.partition("@")[0]} - {""}
            for adapter in [*pool.lora_adapters, *registry_adapters(config, bases)]:
                hints.add_adapter(adapter, pool.model)
    return hints


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
