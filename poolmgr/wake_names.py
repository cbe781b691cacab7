"""Which pool the router's unserved demand is for: every name a client may use for a pool's
model wakes it when the pool is at zero (pools[].autoscale.min = 0).

The router records a Route that found no replica under the name asked, and under the served
name an alias routes to (ReplicaList.unserved); an alias or a LoRA adapter with no replica
at all is recorded under the registry version it resolves to, the alias's drawn version or
the adapter's base version (ReplicaList.unserved_refs: name@version, or a base model's name
for an adapter bound to no version). A pool at zero has no replica that could tell the
router its served name, so the mapping to pools is made here: a pool with a model_ref
serves the version its model_ref resolves to now, which is what a replica started now
would serve. `demand_by_model` gives the served-name -> age mapping the autoscaler reads
(poolmgr/autoscale_pools.py); the versions are read from the model registry at most every
`refresh_s`, and only while the router reports unserved versions.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcserve.config import PoolConfig
from hpcserve.modelcache.registry import Registry, RegistryError

log = logging.getLogger(__name__)


def demand_by_model(
    pools: Sequence[PoolConfig],
    unserved: Mapping[str, float],
    unserved_refs: Mapping[str, float],
    versions: Mapping[str, str],
) -> dict[str, float]:
    """Served name -> seconds since a Route for any name of it found no replica: `unserved`
    (by name) with each pool's version in `unserved_refs` added under the pool's served
    name (the youngest age wins). versions: pool -> the registry version it serves
    (name@version)."""
    out = dict(unserved)
    for pool in pools:
        ref = versions.get(pool.name)
        if not ref:
            continue
        ages = [unserved_refs[key] for key in (ref, ref.partition("@")[0]) if key in unserved_refs]
        if pool.model in out:
            ages.append(out[pool.model])
        if ages:
            out[pool.model] = min(ages)
    return out


class PoolVersions:
    """Pool -> the registry version (name@version) its model_ref resolves to, read from the
    model registry at most every `refresh_s`; a pool whose ref does not resolve is left out
    (logged once per change of what is wrong)."""

    def __init__(self, registry_path: str | Path, refresh_s: float = 10.0) -> None:
        self.registry_path = Path(registry_path)
        self.refresh_s = refresh_s
        self._versions: dict[str, str] = {}
        self._read_at: float | None = None
        self._key: tuple[tuple[str, str], ...] = ()
        self._problems: dict[str, str] = {}  # pool -> why its ref did not resolve (logged)

    def of(self, pools: Sequence[PoolConfig], now: float) -> dict[str, str]:
        wanted = tuple((p.name, p.model_ref) for p in pools if p.model_ref)
        fresh = self._read_at is not None and now - self._read_at < self.refresh_s
        if wanted != self._key or not fresh:
            self._versions = self._read(wanted)
            self._key, self._read_at = wanted, now
        return self._versions

    def _read(self, wanted: tuple[tuple[str, str], ...]) -> dict[str, str]:
        if not wanted:
            return {}
        out: dict[str, str] = {}
        problems: dict[str, str] = {}
        if not self.registry_path.exists():
            problems = {pool: f"no model registry at {self.registry_path}" for pool, _ in wanted}
        else:
            try:
                with Registry(self.registry_path) as registry:
                    for pool, ref in wanted:
                        try:
                            out[pool] = registry.version(ref).ref
                        except RegistryError as err:
                            problems[pool] = str(err)
            except (OSError, sqlite3.Error) as err:
                problems = {pool: f"cannot read {self.registry_path}: {err}" for pool, _ in wanted}
        for pool, why in problems.items():
            if self._problems.get(pool) != why:
                log.warning(
                    "pool %s: its model_ref does not resolve (%s): requests for its aliases "
                    "and adapters cannot wake it from zero",
                    pool,
                    why,
                )
        for pool in self._problems.keys() & out.keys():
            log.info("pool %s: its model_ref resolves again, to %s", pool, out[pool])
        self._problems = problems
        return out
