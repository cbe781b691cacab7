"""Aliases in routing: a request may name an alias of the model registry (`extraction` ->
`llama-8b-docs@3`), optionally with a canary (N% to another version).

The router reads the aliases from the registry database on the control node
(`AliasCatalog`, every `refresh_s`, and on an unknown name at most every `miss_refresh_s`),
so `hpcserve models alias|promote` takes effect within seconds without restarting anything.
Replicas say which version they serve (`Register.model_ref`, name@version); an alias's
candidates are the replicas serving the version it resolves to, under their served name.

The canary split draws u in [0, 1) per request: from a hash of the alias and the request's
session key (`x-session-id`) or, without one, its OpenAI `user`, so one conversation or
user stays on one version; at random when the request carries neither. Since u is fixed
per user, raising the canary share only moves users onto the canary, never back, and
`promote` (share 100) moves everyone to the new version.

A served model name wins over an alias of the same name (the registry keeps alias and model
names apart, but a pool's served name is free).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcserve.contracts import protocol as p
from hpcserve.modelcache.registry import Alias
from hpcserve.router.registry import Registry, Replica
from hpcserve.router.registry_catalog import RegistryCatalog

log = logging.getLogger(__name__)

ALIAS_NO_REPLICA = "alias_no_replica"


def sticky_draw(alias: str, key: str) -> float:
    """A uniform draw in [0, 1) fixed by (alias, key): the same user, the same version."""
    digest = hashlib.blake2b(f"{alias}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class AliasCatalog(RegistryCatalog[Alias]):
    """Alias name -> the registry's Alias (target, canary, share), from the model registry
    (router/registry_catalog.py), re-read every 2 s by default: a promote takes effect soon."""

    what = "aliases"

    def __init__(
        self, read: Callable[[], Iterable[Alias]], *, refresh_s: float = 2.0, **kwargs: Any
    ) -> None:
        super().__init__(read, refresh_s=refresh_s, **kwargs)

    @classmethod
    def from_registry(cls, path: str, **kwargs: float) -> AliasCatalog:
        def read() -> list[Alias]:
            from hpcserve.modelcache.registry import Registry as ModelRegistry

            if not Path(path).exists():
                return []
            with ModelRegistry(Path(path)) as registry:
                return registry.aliases()

        return cls(read, **kwargs)

    def changed(self, old: dict[str, Alias], new: dict[str, Alias]) -> None:
        for name in new.keys() | old.keys():
            if _describe(new.get(name)) != _describe(old.get(name)):
                log.info("alias %s: %s", name, _describe(new.get(name)))


def _describe(entry: Alias | None) -> str:
    if entry is None:
        return "removed"
    if entry.canary:
        return f"{entry.target}, canary {entry.canary} at {entry.canary_percent}%"
    return entry.target


@dataclass(frozen=True)
class AliasDecision:
    """Route among `candidates` (replicas of served model `model`, serving `ref`), or fail
    with `error`."""

    ref: str = ""
    model: str = ""
    candidates: list[Replica] | None = None
    error: str = ""


class AliasRouter:
    """Resolves alias requests; `attach` it to the router's Registry so it knows, per
    version, which live replicas serve it."""

    def __init__(self, catalog: AliasCatalog, *, rng: random.Random | None = None) -> None:
        self.catalog = catalog
        self._random = (rng or random.Random()).random
        self._by_ref: dict[str, dict[str, Replica]] = {}  # name@version -> id -> replica
        self._ref_of: dict[str, str] = {}

    def attach(self, registry: Registry) -> None:
        registry.on_add.append(self._added)
        registry.on_remove.append(self._removed)

    def _added(self, replica: Replica) -> None:
        ref = replica.spec.model_ref
        if ref:
            self._by_ref.setdefault(ref, {})[replica.replica_id] = replica
            self._ref_of[replica.replica_id] = ref

    def _removed(self, replica_id: str) -> None:
        ref = self._ref_of.pop(replica_id, None)
        if ref is not None:
            serving = self._by_ref[ref]
            serving.pop(replica_id, None)
            if not serving:
                del self._by_ref[ref]

    def resolve(self, msg: p.Route, registry: Registry) -> AliasDecision | None:
        """None when `msg.model` is no alias; else the version drawn and its replicas."""
        entry = self.catalog.get(msg.model)
        if entry is None:
            return None
        key = msg.session_key or msg.user
        u = sticky_draw(entry.name, key) if key else self._random()
        ref = entry.pick(u)
        model, candidates = self._serving(ref, registry)
        if not candidates:
            return AliasDecision(ref=ref, error=ALIAS_NO_REPLICA)
        return AliasDecision(ref, model, candidates)

    def _serving(self, ref: str, registry: Registry) -> tuple[str, list[Replica]]:
        """The served model with the most routable replicas serving `ref`, and its replicas
        serving `ref` (all of them, when the model's replicas all serve it)."""
        by_model: dict[str, list[Replica]] = {}
        for replica in self._by_ref.get(ref, {}).values():
            by_model.setdefault(replica.model, []).append(replica)
        if not by_model:
            return "", []
        model = max(sorted(by_model), key=lambda m: sum(r.routable for r in by_model[m]))
        if not any(r.routable for r in by_model[model]):
            return "", []
        serving = by_model[model]
        everyone = registry.for_model(model)
        return model, everyone if len(everyone) == len(serving) else serving

    def listing(self, registry: Registry) -> list[p.ModelInfo]:
        """Every alias whose target or canary a live replica serves (a served model of the
        same name hides it)."""
        models = registry.models()
        listed = []
        for a in sorted(self.catalog.all(), key=lambda a: a.name):
            count = sum(
                r.routable
                for ref in (a.target, a.canary or "")
                for r in self._by_ref.get(ref, {}).values()
            )
            if count and a.name not in models:
                listed.append(p.ModelInfo(id=a.name, replicas=count, alias_of=a.target))
        return listed
