"""The LoRA plan a pool manager writes for a pool with LoRA on, and its engines read: the
adapter slots and the adapters loaded at start (each with its digest manifest)."""

from __future__ import annotations

import msgspec


class StaticAdapter(msgspec.Struct, frozen=True):
    name: str
    source: str
    manifest: str  # the adapter's digest manifest, JSON text


class LoraPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_loras: int
    max_lora_rank: int
    adapters: list[StaticAdapter] = []
