"""A disaggregated model's two autoscaled pools on the real two-node Slurm cluster, each sized
on its own signals (poolmgr/autoscale_roles.py, issues 19 and 22), with simulated engines.

A prefill pool whose engine computes one long prompt at a time (fixed timing, 1 ms per
prompt token, --max-num-seqs 1) and a decode pool that loads each prompt's KV cache instead
(sim/transfer.py); clients send long prompts through the real gateway (its two steps) and
router with the official openai client. The prompts queue on the prefill replica: the
prefill pool grows. The decode replica runs what reaches it in a few decode steps: the
decode pool stays at one, though the router counts it in flight for every request waiting
for its prefill (which a pool sized on that count would have followed up).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import parse_config
from hpcserve.poolmgr.manager import PoolManager
from tests.integration.pool_rig import PoolRig, poll_until

pytestmark = pytest.mark.slurm

KEY = "sk-autoscale-pd-test"
CLIENTS = 6
COMMON = {
    "served_model_name": "chat",
    "model_path": "/nonexistent",
    "engine": "sim",
    "replicas": 1,
}
AUTOSCALE = {
    "min": 1,
    "max": 2,
    "max_waiting_per_replica": 1,
    "scale_up_window_s": 1,
    "scale_up_cooldown_s": 0,
}
PREFILL = {
    **COMMON,
    "name": "chat-prefill",
    "role": "prefill",
    "engine_args": ["--prefill-ms-per-token", "1", "--decode-ms-per-token", "5",
                    "--max-num-seqs", "1"],
    "autoscale": AUTOSCALE,
}  # fmt: skip
DECODE = {
    **COMMON,
    "name": "chat-decode",
    "role": "decode",
    "engine_args": ["--prefill-ms-per-token", "1", "--decode-ms-per-token", "5"],
    # Six requests in flight would need two replicas at 3 each, were they counted.
    "autoscale": {**AUTOSCALE, "target_in_flight": 3},
}


def document(i: int) -> list[dict[str, str]]:
    """A long prompt (about 1,500 words: 1.5 s of the prefill replica's time)."""
    words = " ".join(f"item{k} weight {k * i} kg" for k in range(375))
    return [{"role": "user", "content": f"Bill of lading {i}. Extract the consignee. {words}"}]


def test_long_prompts_grow_the_prefill_pool_and_not_the_decode_pool(rig: PoolRig) -> None:
    data: dict[str, Any] = msgspec.to_builtins(rig.config("pdas", {"model_path": "/nonexistent"}))
    data["pools"] = [PREFILL, DECODE]
    config = parse_config(data)
    manager = PoolManager(config, rig.slurm, metrics_registry=CollectorRegistry())
    decode_targets: list[int] = []

    def poll() -> None:
        manager.poll_once()
        decision = manager.autoscaled.decisions.get("chat-decode")
        if decision is not None:
            decode_targets.append(decision.target)

    def serving(pool: str) -> int:
        return len(rig.serving(pool))

    poll_until(poll, "a prefill and a decode replica", lambda: serving("chat-prefill") == 1
               and serving("chat-decode") == 1)  # fmt: skip
    stop = threading.Event()
    answered: list[int] = []
    errors: list[str] = []
    with (
        rig.openai_client(config, KEY, {"chat"}) as client,
        ThreadPoolExecutor(CLIENTS) as threads,
    ):

        def loop(i: int) -> None:
            while not stop.is_set():
                try:
                    reply = client.chat.completions.create(
                        model="chat", messages=document(i), max_tokens=16
                    )
                    assert reply.usage is not None and reply.usage.completion_tokens == 16
                    answered.append(reply.usage.prompt_tokens)
                except Exception as err:  # every failure is recorded, and asserted on
                    errors.append(repr(err))

        try:
            for i in range(CLIENTS):
                threads.submit(loop, i)
            poll_until(poll, "two prefill replicas serving", lambda: serving("chat-prefill") == 2)
            # Requests keep coming through both prefill replicas for a while: the decode
            # pool is asked again at every poll meanwhile.
            done = len(answered)
            poll_until(poll, "more requests answered", lambda: len(answered) >= done + CLIENTS)
        finally:
            stop.set()
    history = rig.history()
    assert errors == [], errors[:3]
    assert min(answered) > 1000  # long prompts
    prefill_up = manager.autoscaled.states["chat-prefill"].last_reason
    assert prefill_up.startswith("up 1->2: ") and "waiting per replica > 1" in prefill_up, history
    assert decode_targets and set(decode_targets) == {1}, history
    assert serving("chat-decode") == 1
    decode = rig.serving("chat-decode")
    assert decode[0].routed >= len(answered)  # every request was decoded there
