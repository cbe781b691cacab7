"""LoRA adapters in routing: send an adapter's requests to replicas that have it loaded, and
load it on demand when none has.

A request names an adapter as its `model`. The replicas that may serve it run the base-model
version the adapter is bound to in the model registry (their `model_ref`, e.g. `llama-8b@2`)
with LoRA on (`max_adapters` > 0). Among those:

1. Replicas that report the adapter loaded are the candidates; the usual policy picks one.
2. If none has it, the least-loaded eligible replica is told to load it (LoadAdapter on the
   registry socket, answered by AdapterLoaded); when that replica already holds
   `max_adapters`, its least recently routed adapter with no request in flight there is
   unloaded first (a replica whose adapters are all busy takes no load; when every
   replica is so, the request is answered `adapter_loading`, to ask again once requests
   end). Until the answer
   comes the request is answered `adapter_loading` and the gateway asks again (bounded by
   its own wait), so the router never holds a reply open. A load that fails, or that is not
   answered within `load_timeout_s`, is reported once as `adapter_load_failed`; the next
   request tries again.

What is loaded comes from the engines (Register, Heartbeat, AdapterLoaded): the router's
picture follows theirs. Requests in flight per adapter and replica are counted here: +1 when
routed, -1 when the gateway's Release names the adapter, and all cleared when the replica
has no routed request left (so a Release that names no model cannot leave a count behind).
Which adapters exist, and for which base version, comes from the model registry
(`AdapterCatalog`), re-read at most every `refresh_s`, so an adapter added with
`hpcserve models add --lora-base` is servable without a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcserve.contracts import protocol as p
from hpcserve.router.policies.pool_roles import role_replicas
from hpcserve.router.registry import Replica
from hpcserve.router.registry_catalog import RegistryCatalog

log = logging.getLogger(__name__)

LOADING = "adapter_loading"
LOAD_FAILED = "adapter_load_failed"
NO_REPLICA = "no_replica"


@dataclass(frozen=True)
class AdapterSource:
    """One adapter as the registry knows it: what a replica needs to stage and load it."""

    name: str
    base_model: str
    source: str
    manifest: bytes  # its digest manifest, JSON
    base_version: int = 0  # the base version it is bound to; 0: any (no version known)

    def fits(self, base_model: str, base_ref: str) -> bool:
        """May a replica of `base_model`, serving registry version `base_ref`, load it?"""
        if self.base_version:
            return base_ref == f"{self.base_model}@{self.base_version}"
        return base_model == self.base_model


class AdapterCatalog(RegistryCatalog[AdapterSource]):
    """Adapter name -> AdapterSource, from the model registry (router/registry_catalog.py)."""

    what = "LoRA adapters"

    @classmethod
    def from_registry(cls, path: str, **kwargs: Any) -> AdapterCatalog:
        def read() -> list[AdapterSource]:
            from hpcserve.modelcache.registry import Registry

            if not Path(path).exists():
                return []
            with Registry(Path(path)) as registry:
                return [
                    AdapterSource(
                        a.name,
                        a.base_model,
                        a.path,
                        registry.adapter_manifest(a.name).encode(),
                        a.base_version,
                    )
                    for a in registry.adapters()
                ]

        return cls(read, **kwargs)


@dataclass
class _ReplicaAdapters:
    peer: bytes  # the engine agent's identity on the registry socket
    base_model: str
    max_adapters: int
    base_ref: str = ""  # the registry version it serves (name@version), "" if unknown
    loaded: dict[str, float] = field(default_factory=dict)  # adapter -> last routed at
    loading: dict[str, float] = field(default_factory=dict)  # adapter -> deadline
    in_flight: dict[str, int] = field(default_factory=dict)  # adapter -> routed, unreleased

    def serves(self, source: AdapterSource) -> bool:
        return source.fits(self.base_model, self.base_ref)


@dataclass(frozen=True)
class AdapterDecision:
    """Route among `candidates`; or send `load` to the agent at `peer`; or fail with `error`
    (LOADING: ask again soon)."""

    candidates: Sequence[Replica] = ()
    load: p.LoadAdapter | None = None
    peer: bytes = b""
    error: str = ""


class AdapterRouter:
    def __init__(
        self,
        catalog: AdapterCatalog,
        *,
        load_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.catalog = catalog
        self.load_timeout_s = load_timeout_s
        self._clock = clock
        self._replicas: dict[str, _ReplicaAdapters] = {}
        self._failed: dict[str, str] = {}  # adapter -> why its last load failed

    # -- what the engines report

    def on_register(self, msg: p.Register, peer: bytes) -> None:
        if msg.max_adapters <= 0:
            self._replicas.pop(msg.replica_id, None)
            return
        now = self._clock()
        old = self._replicas.get(msg.replica_id)
        state = _ReplicaAdapters(
            peer, msg.base_model or msg.model, msg.max_adapters, base_ref=msg.model_ref
        )
        state.loaded = {a: (old.loaded.get(a, 0.0) if old else 0.0) for a in msg.adapters}
        if old is not None:
            state.loading = {a: d for a, d in old.loading.items() if d > now}
            state.in_flight = old.in_flight
        self._replicas[msg.replica_id] = state

    def on_heartbeat(self, msg: p.Heartbeat, peer: bytes) -> None:
        state = self._replicas.get(msg.replica_id)
        if state is None or msg.adapters is None:
            return
        state.peer = peer
        self._set_loaded(state, msg.adapters)

    def on_loaded(self, msg: p.AdapterLoaded) -> None:
        state = self._replicas.get(msg.replica_id)
        if state is None:
            return
        state.loading.pop(msg.adapter, None)
        self._set_loaded(state, msg.adapters)
        if msg.error:
            self._failed[msg.adapter] = f"{msg.replica_id}: {msg.error}"
            log.warning(
                "LoRA adapter %s failed to load on %s: %s", msg.adapter, msg.replica_id, msg.error
            )
        else:
            state.loaded[msg.adapter] = self._clock()
            log.info("LoRA adapter %s loaded on %s", msg.adapter, msg.replica_id)

    def forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    # -- routing

    def base_of(self, adapter: str) -> str:
        """The registry version an adapter is bound to (name@version), its base model's name
        when bound to none, "" when the registry does not know it: what a pool at zero must
        serve for the adapter's requests to wake it (router/unserved.py)."""
        source = self.catalog.get(adapter)
        if source is None:
            return ""
        if source.base_version:
            return f"{source.base_model}@{source.base_version}"
        return source.base_model

    def is_adapter(self, model: str) -> bool:
        return self.catalog.get(model) is not None or any(
            model in s.loaded for s in self._replicas.values()
        )

    def route(
        self,
        adapter: str,
        live: Iterable[Replica],
        *,
        priority: str = "interactive",
        lend_below: int = 0,
    ) -> AdapterDecision:
        """Where a request for `adapter` goes, given the live replicas. `priority` and
        `lend_below` restrict both the holders and the load target to the replicas the
        request's role may use (router/policies/pool_roles.py)."""
        now = self._clock()
        live_by_id = {r.replica_id: r for r in live}
        for gone in self._replicas.keys() - live_by_id.keys():
            del self._replicas[gone]
        source = self.catalog.get(adapter)
        # A replica out of routing (unhealthy, draining) neither serves nor gets a load, nor
        # one of the other pool role (a batch replica for an interactive request...).
        capable = [
            live_by_id[rid]
            for rid, s in self._replicas.items()
            if rid in live_by_id
            and live_by_id[rid].routable
            and (adapter in s.loaded if source is None else s.serves(source))
        ]
        routable = {r.replica_id for r in role_replicas(capable, priority, lend_below)}
        holders = [
            live_by_id[rid]
            for rid, s in self._replicas.items()
            if adapter in s.loaded and rid in routable and (source is None or s.serves(source))
        ]
        if holders:
            return AdapterDecision(candidates=holders)
        if source is None:
            return AdapterDecision(error=NO_REPLICA)
        eligible = [
            rid for rid, s in self._replicas.items() if s.serves(source) and rid in routable
        ]
        if not eligible:
            return AdapterDecision(error=NO_REPLICA)
        for rid in eligible:
            deadline = self._replicas[rid].loading.get(adapter)
            if deadline is None:
                continue
            if now < deadline:
                return AdapterDecision(error=LOADING)
            del self._replicas[rid].loading[adapter]
            self._failed[adapter] = f"{rid}: no answer within {self.load_timeout_s:g}s"
        failed = self._failed.pop(adapter, None)
        if failed is not None:
            return AdapterDecision(error=LOAD_FAILED)
        victims = {
            rid: v for rid in eligible if (v := self._lru_victims(self._replicas[rid])) is not None
        }
        if not victims:
            # Every eligible replica is full of adapters with requests in flight: ask again
            # once some end (the gateway's wait bounds this).
            return AdapterDecision(error=LOADING)
        target = min(victims, key=lambda rid: self._load_key(live_by_id[rid], rid))
        state = self._replicas[target]
        unload = victims[target]
        state.loading[adapter] = now + self.load_timeout_s
        for victim in unload:
            state.loaded.pop(victim, None)
        log.info(
            "loading LoRA adapter %s on %s%s",
            adapter,
            target,
            f" (unloading {', '.join(unload)})" if unload else "",
        )
        load = p.LoadAdapter(target, adapter, source.source, source.manifest, unload)
        return AdapterDecision(load=load, peer=state.peer, error=LOADING)

    def routed(self, replica_id: str, adapter: str) -> None:
        """A request for `adapter` went to `replica_id`: in flight there until released
        (and recency for the LRU choice)."""
        state = self._replicas.get(replica_id)
        if state is None:
            return
        state.in_flight[adapter] = state.in_flight.get(adapter, 0) + 1
        if adapter in state.loaded:
            state.loaded[adapter] = self._clock()

    def released(self, replica_id: str, model: str, *, idle: bool) -> None:
        """A request routed to `replica_id` ended. `model`: what it asked for ("" when the
        gateway did not say); `idle`: the replica has no routed request left."""
        state = self._replicas.get(replica_id)
        if state is None:
            return
        if idle:
            state.in_flight.clear()
            return
        left = state.in_flight.get(model, 0) - 1
        if left > 0:
            state.in_flight[model] = left
        else:
            state.in_flight.pop(model, None)

    def in_flight(self, replica_id: str, adapter: str) -> int:
        state = self._replicas.get(replica_id)
        return state.in_flight.get(adapter, 0) if state is not None else 0

    def listing(self, live: Iterable[Replica]) -> list[p.ModelInfo]:
        """Every adapter a live replica has loaded or could load, as models with a parent."""
        counts: dict[str, int] = {}
        parents: dict[str, str] = {}
        states = []
        for replica in live:
            state = self._replicas.get(replica.replica_id)
            if state is None:
                continue
            states.append((state, replica.model))
            for adapter in state.loaded:
                counts[adapter] = counts.get(adapter, 0) + 1
                parents.setdefault(adapter, replica.model)
        for source in self.catalog.all():
            served_as = next((model for state, model in states if state.serves(source)), None)
            if served_as is not None:
                counts.setdefault(source.name, 0)
                parents.setdefault(source.name, served_as)
        return [p.ModelInfo(id=a, replicas=counts[a], parent=parents[a]) for a in sorted(counts)]

    def _load_key(self, replica: Replica, rid: str) -> tuple[int, int, str]:
        state = self._replicas[rid]
        full = len(state.loaded) + len(state.loading) >= state.max_adapters
        return (replica.queued, int(full), rid)

    @staticmethod
    def _lru_victims(state: _ReplicaAdapters) -> list[str] | None:
        """The adapters to unload to make room for one more, least recently routed first,
        never one with a request in flight; None when the replica cannot make room now."""
        excess = len(state.loaded) + len(state.loading) + 1 - state.max_adapters
        if excess <= 0:
            return []
        idle = [a for a in state.loaded if not state.in_flight.get(a)]
        if len(idle) < excess:
            return None
        return sorted(idle, key=lambda a: (state.loaded[a], a))[:excess]

    @staticmethod
    def _set_loaded(state: _ReplicaAdapters, names: Iterable[str]) -> None:
        state.loaded = {a: state.loaded.get(a, 0.0) for a in names}
