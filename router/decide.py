"""One routing decision: session affinity, then the prefix index, then the policy.

Holds what the decision needs besides the registry: the PrefixIndex (fed by the KV-event
subscriber for replicas that publish events, and by RoutedPrefixes: the approximate mode
for those that do not, pending blocks of routed prompts for those that do), the session
table and the configured policy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from hpcserve.config import RoutingConfig
from hpcserve.contracts import protocol as p
from hpcserve.router.affinity import SessionAffinity
from hpcserve.router.approx_index import RoutedPrefixes
from hpcserve.router.kv_subscriber import KvEventSubscriber
from hpcserve.router.policies import build_policy
from hpcserve.router.policies.base import Cached, RouteContext, RouteRequest
from hpcserve.router.prefix_index import PrefixIndex
from hpcserve.router.registry import Registry, Replica
from hpcserve.router.replica_table import ReplicaTable


class RoutedTokens(Collector):
    """Prompt tokens of routed requests that sent block hashes, and of those the tokens the
    index showed cached on the chosen replica (their ratio: the predicted prefix hit rate),
    per model; read from the Decider's plain counts at scrape time."""

    def __init__(self, counts: dict[str, list[int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        prompt = CounterMetricFamily(
            "hpcserve_router_prompt_tokens",
            "Prompt tokens of routed requests (those that sent block hashes)",
            labels=["model"],
        )
        cached = CounterMetricFamily(
            "hpcserve_router_cached_prompt_tokens",
            "Of those, tokens the index showed cached on the chosen replica",
            labels=["model"],
        )
        for model, (prompt_tokens, cached_tokens) in list(self.counts.items()):
            prompt.add_metric([model], prompt_tokens)
            cached.add_metric([model], cached_tokens)
        yield prompt
        yield cached


# A Route's hash_stride is taken as at most this (a gateway's is at most 4,096, the most
# gateway.prefix_hash_tokens allows): token counts stay far inside the int64 arrays.
MAX_HASH_STRIDE = 4096


class Decider:
    def __init__(
        self,
        config: RoutingConfig,
        registry: Registry,
        *,
        index: PrefixIndex | None = None,
        subscriber: KvEventSubscriber | None = None,
        rng: random.Random | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.index = index if index is not None else PrefixIndex()
        self.subscriber = subscriber
        self.policy = build_policy(config, rng)
        self.approx = RoutedPrefixes(self.index, config.approx_ttl_s, config.approx_max_blocks)
        self.sessions = SessionAffinity(config.session_ttl_s, config.session_max)
        # Model -> [prompt tokens, cached prompt tokens] of routed requests: plain ints
        # added to per decision, exposed as counters when scraped (RoutedTokens).
        self.routed_tokens: dict[str, list[int]] = {}
        (metrics_registry or CollectorRegistry()).register(RoutedTokens(self.routed_tokens))
        self._held_at: dict[int, float] = {}
        # The registered replica of each prefix-index slot (None: none), so that a match's
        # slots become table rows without a lookup by id.
        self._by_slot: list[Replica | None] = []
        # (replica, block hashes, when, TTL or None, blocks it held) of routed prompts,
        # until record_routed.
        self._unrecorded: list[tuple[Replica, Sequence[int], float, float | None, int]] = []

    # --- membership -----------------------------------------------------------------
    def replica_added(self, replica: Replica) -> None:
        self._bind_slot(self.index.slot(replica.replica_id))
        spec = replica.spec
        publishes = spec.kv_events_endpoint or spec.kv_events_relayed
        if self.subscriber is not None and self.config.kv_events and publishes:
            self.subscriber.watch(
                spec.replica_id,
                spec.kv_events_endpoint,
                spec.kv_replay_endpoint,
                spec.kv_events_topic or spec.replica_id,
                relayed=spec.kv_events_relayed,
            )

    def _bind_slot(self, slot: int) -> Replica | None:
        replica_id = self.index.replica_of(slot)
        replica = self.registry.get(replica_id) if replica_id is not None else None
        if slot >= len(self._by_slot):
            self._by_slot.extend([None] * (slot + 1 - len(self._by_slot)))
        self._by_slot[slot] = replica
        return replica

    def record_routed(self) -> None:
        """Record the blocks of the prompts routed since the last call (approx_index.py).
        Costs about what ingesting them from events does, so the server calls it after
        sending a batch's replies rather than inside the decision; the next pick calls it
        at the latest."""
        items, self._unrecorded = self._unrecorded, []
        for replica, hashes, now, ttl_s, skip in items:
            if replica.row >= 0:  # still registered
                self.approx.routed(replica.replica_id, hashes, now, ttl_s=ttl_s, skip=skip)

    def replica_removed(self, replica_id: str) -> None:
        slot = self.index.slot_of(replica_id)
        if slot is not None and slot < len(self._by_slot):
            self._by_slot[slot] = None
        if self.subscriber is not None:
            self.subscriber.unwatch(replica_id)
        self.index.drop(replica_id)

    def _has_events(self, replica_id: str) -> bool:
        return self.subscriber is not None and self.subscriber.watching(replica_id)

    # --- decisions ------------------------------------------------------------------
    def request_of(self, msg: p.Route, model: str) -> RouteRequest:
        stride = min(max(1, msg.hash_stride), MAX_HASH_STRIDE)
        sampled = len(msg.block_hashes) * stride  # at least the blocks the samples cover
        hashed = min(msg.hashed_blocks, sampled) if msg.hashed_blocks > 0 else sampled
        return RouteRequest(
            model=model,
            block_hashes=msg.block_hashes,
            block_size=msg.block_size,
            prompt_tokens=max(msg.prompt_tokens, hashed * msg.block_size),
            adapter=msg.adapter,
            priority=msg.priority,
            session_key=msg.session_key,
            hash_stride=stride,
            hashed_blocks=hashed,
        )

    def cached_tokens(self, request: RouteRequest, table: ReplicaTable) -> Cached | None:
        """Prompt tokens the rows hold in their KV cache; None when no row holds any."""
        if not request.block_hashes or request.block_size <= 0:
            return None
        slots, depths = self.index.match_slots(request.block_hashes)
        if not slots:
            return None
        rows: list[int] = []
        tokens: list[int] = []
        by_slot, sizes, ids = self._by_slot, self.index.block_sizes, self.index.slot_ids
        model, block_size = request.model, request.block_size
        stride, hashed = request.hash_stride, request.hashed_blocks
        for slot, depth in zip(slots, depths, strict=True):
            replica = by_slot[slot] if slot < len(by_slot) else None
            if replica is None or replica.replica_id != ids[slot]:
                # The index reuses a dropped replica's slot (an unwatched stream, the
                # approximate mode taking over): bind the slot to its replica now.
                replica = self._bind_slot(slot)
            if replica is None or replica.row < 0:
                continue
            spec = replica.spec
            if spec.model != model:
                continue
            size = sizes[slot] or spec.block_size
            if size and size != block_size:
                continue  # hashes of another block size cannot match
            rows.append(replica.row)
            tokens.append(min(depth * stride, hashed) * block_size)
        if not rows:
            return None
        return Cached(rows, tokens)

    def _sticky(
        self, request: RouteRequest, table: ReplicaTable, now: float, allowed: np.ndarray | None
    ) -> Replica | None:
        replica_id = self.sessions.lookup(request.session_key, now)
        replica = self.registry.get(replica_id) if replica_id else None
        if replica is None or replica.model != request.model or not replica.routable:
            return None
        # The policy's filters hold for a session too (a batch pool, an adapter's hosts).
        kept = self.policy.keep_mask(RouteContext(request, table, None, allowed))
        if kept is not None and not kept[replica.row]:
            return None
        mine, floor = table.load[replica.row], table.load_floor()
        if mine > floor + self.config.overload_abs and mine > self.config.overload_rel * floor:
            return None  # affinity never outweighs a queue
        return replica

    HELD_REFRESH_S = 0.05

    def _refresh_held(self, table: ReplicaTable, now: float) -> None:
        """Each replica's KV-cache contents in tokens, from the index (at most every 50 ms:
        one dict lookup per replica)."""
        if now - self._held_at.get(id(table), -1.0) < self.HELD_REFRESH_S:
            return
        self._held_at[id(table)] = now
        for replica in table.replicas:
            size = self.index.block_size(replica.replica_id) or replica.spec.block_size
            table.held_tokens[replica.row] = self.index.blocks(replica.replica_id) * size

    def pick(
        self,
        msg: p.Route,
        now: float,
        candidates: Sequence[Replica] | None = None,
        phase: str = "",
    ) -> Replica | None:
        """The replica for this request, counted as routed; None when there is none.

        `candidates` narrows the choice to some replicas of one model (a LoRA adapter's
        hosts, a retry excluding replicas); None means every replica of `msg.model`.
        `phase` "prefill": the prefill replica of a disaggregated request (policies/
        pd_roles.py), picked by the policy alone (a session sticks to its decode replica).
        """
        if self._unrecorded:
            self.record_routed()
        model = msg.model if candidates is None else (candidates[0].model if candidates else "")
        table = self.registry.table(model) if model else None
        if table is None or not len(table):
            return None
        allowed: np.ndarray | None = None
        if candidates is not None and len(candidates) != len(table):
            allowed = np.zeros(len(table), bool)
            allowed[[r.row for r in candidates if r.model == model and r.row >= 0]] = True
        request = self.request_of(msg, model)
        request.phase = phase
        sticky = request.session_key and not phase
        replica = self._sticky(request, table, now, allowed) if sticky else None
        if replica is None:
            if self.policy.uses_prefix and (
                self.config.kv_capacity_tokens or table.kv_capacity_rows
            ):
                self._refresh_held(table, now)
            cached = self.cached_tokens(request, table) if self.policy.uses_prefix else None
            replica = self.policy.pick(RouteContext(request, table, cached, allowed))
        else:
            cached = self.cached_tokens(request, table)
        if replica is None:
            return None
        if request.block_hashes:
            counts = self.routed_tokens.get(request.model)
            if counts is None:
                counts = self.routed_tokens[request.model] = [0, 0]
            counts[0] += request.prompt_tokens
            if cached is not None:
                counts[1] += cached.at(replica.row)
        self.registry.routed(replica, request.prompt_tokens)
        table.note_routed(replica.row)
        if request.block_hashes:
            # With events, the blocks this replica lacks are pending until its events store
            # them; without, every routed block counts as cached for the approximate TTL.
            # Recorded by record_routed, once the reply is on its way.
            prefix = self.policy.uses_prefix
            if self._has_events(replica.replica_id):
                self.subscriber.prompt_sent(replica.replica_id)  # type: ignore[union-attr]
                if prefix and self.config.pending_ttl_s:
                    held = _hashes_held(request, cached.at(replica.row)) if cached else 0
                    self._unrecorded.append(
                        (replica, request.block_hashes, now, self.config.pending_ttl_s, held)
                    )
            elif prefix:
                self._unrecorded.append((replica, request.block_hashes, now, None, 0))
        if sticky:
            self.sessions.remember(request.session_key, replica.replica_id, now)
        return replica


def _hashes_held(request: RouteRequest, cached_tokens: int) -> int:
    """How many of the request's leading block hashes `cached_tokens` (from cached_tokens)
    stand for."""
    blocks = cached_tokens // request.block_size
    if blocks >= request.hashed_blocks:
        return len(request.block_hashes)
    return blocks // request.hash_stride
