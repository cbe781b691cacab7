"""The simulated engine's KV transfer: a prefill or decode replica of a disaggregated pool.

What a vLLM engine with a KV-transfer connector does, as the gateway drives it
(gateway/disagg.py), with NixlConnector's request parameters:

- prefill: a request whose ``kv_transfer_params`` say ``do_remote_decode`` is computed as
  usual (the gateway asks for one token) and answered with the parameters a decode engine
  needs: ``do_remote_prefill: true``, this engine's id, the request's block ids, the
  prompt's token count (``remote_num_tokens``), as vLLM's NIXL connector answers;
- decode: a request whose parameters say ``do_remote_prefill`` (with ``remote_block_ids``)
  loads the prompt's KV cache instead of computing it: the tokens its own prefix cache does
  not hold move over the link, ``latency + tokens x KV bytes per token / bandwidth``
  (``--sim-kv-link-gbps``, ``--sim-kv-link-latency-ms``; KV bytes per token from the
  planner's model spec), and the request then joins the queue with its whole prompt
  computed but the last token (vLLM recomputes that one for its logits, and counts the
  whole prompt as transferred). The decode engine's counters say so as vLLM's do:
  ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` grows by the
  transferred tokens, ``local_compute`` not at all.

Any connector name in ``--kv-transfer-config`` is taken (the pool manager renders
``SimConnector`` for a sim pool; a pool's own vLLM connector config works the same): the
transfer is modelled, nothing moves between the engines, so a decode replica accepts any
parameters that name blocks. Without ``--kv-transfer-config`` the parameters are ignored,
as by a vLLM engine without a connector.

Modelled apart from vLLM: the transfer is charged before the request waits for KV room on
the decode replica (vLLM allocates first, then pulls); the prefill replica frees its
blocks when it answers (they stay in its prefix cache) where NIXL keeps them until the
decode has read them; the link is uncontended (concurrent transfers do not share it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The planner's "ib" link (hpcserve/planner/pd.py LINKS): InfiniBand NDR at 80% of 400 Gb/s.
DEFAULT_LINK_GBPS = 320.0
DEFAULT_LINK_LATENCY_MS = 0.1


@dataclass(frozen=True)
class KVTransferConfig:
    connector: str  # as --kv-transfer-config names it; any name is modelled alike
    role: str  # kv_producer (prefill), kv_consumer (decode) or kv_both
    link_gbps: float = DEFAULT_LINK_GBPS  # gigabits per second, one transfer
    link_latency_s: float = DEFAULT_LINK_LATENCY_MS / 1e3
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def transfer_s(self, nbytes: float) -> float:
        """Modelled seconds to move ``nbytes`` of KV cache over the link."""
        return self.link_latency_s + nbytes * 8 / (self.link_gbps * 1e9)


def parse(text: str, link_gbps: float, latency_ms: float) -> KVTransferConfig | None:
    """vLLM's --kv-transfer-config JSON (None when absent); ValueError naming the flag."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--kv-transfer-config: not JSON: {err}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("kv_connector"), str):
        raise ValueError(
            f"--kv-transfer-config: expected an object with kv_connector, got {text!r}"
        )
    role = raw.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role {role!r}; allowed: {', '.join(KV_ROLES)}")
    if not link_gbps > 0:
        raise ValueError(f"--sim-kv-link-gbps: must be > 0, got {link_gbps}")
    if not latency_ms >= 0:
        raise ValueError(f"--sim-kv-link-latency-ms: must be >= 0, got {latency_ms}")
    return KVTransferConfig(raw["kv_connector"], role, link_gbps, latency_ms / 1e3)


def remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The request is a prefill step for a decode elsewhere."""
    return bool(params and params.get("do_remote_decode"))


def remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The request's prompt was computed by a prefill replica whose blocks it names."""
    return bool(
        params and params.get("do_remote_prefill") and params.get("remote_block_ids") is not None
    )


def prefill_answer(
    config: KVTransferConfig, request_id: str, block_ids: list[int], tokens: int
) -> dict[str, Any]:
    """What a prefill replica answers (NixlConnector's shape, less its side channel)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [block_ids],
        "remote_engine_id": config.engine_id,
        "remote_request_id": request_id,
        "remote_host": None,
        "remote_port": None,
        "remote_num_tokens": tokens,
        "tp_size": 1,
    }
