"""Router cost at fleet scale: decision latency, KV-event ingest rate, memory per block.

One process, one core, no sockets in the measured paths:
- ingest: vLLM-format KV-event payloads (msgpack, the 0.32 map layout) for REPLICAS
  replicas holding BLOCKS indexed blocks in all (some prefixes shared between replicas),
  decoded and applied to the PrefixIndex; blocks/s with and without the decode;
- memory: tracemalloc's count of the bytes the index holds, per indexed (replica, block);
- decision: Decider.pick (prefix match + filters + scorers + picker + bookkeeping) for
  2,048-token prompts (128 blocks of 16), half of them starting with an indexed document;
  p50/p99 over DECISIONS; also the request-side hashing of such a prompt.

    .venv/bin/python bench/router_cost.py [--replicas 1000] [--blocks 1000000]

Prints a markdown table and writes bench/results/router_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpcserve.config import RoutingConfig  # noqa: E402
from hpcserve.router import kv_wire as kw  # noqa: E402
from hpcserve.router import protocol as p  # noqa: E402
from hpcserve.router.decide import Decider  # noqa: E402
from hpcserve.router.kv_subscriber import KvEventSubscriber  # noqa: E402
from hpcserve.router.prefix_hash import prompt_block_hashes  # noqa: E402
from hpcserve.router.prefix_index import PrefixIndex  # noqa: E402
from hpcserve.router.registry import Registry  # noqa: E402

BS = 16
DOC_BLOCKS = 20  # blocks per stored document (one BlockStored event each)


def make_payloads(replicas: int, blocks: int, rng: random.Random):
    """Per replica, BlockStored batches of DOC_BLOCKS blocks; 30% of documents come from
    a shared pool (so some blocks are held by several replicas)."""
    per_replica = blocks // replicas
    docs_per_replica = max(per_replica // DOC_BLOCKS, 1)
    pool = [[rng.randrange(50_000) for _ in range(BS * DOC_BLOCKS)] for _ in range(500)]
    payloads: list[tuple[str, bytes]] = []
    docs: list[list[int]] = []
    counter = 0
    for r in range(replicas):
        rid = f"r{r}"
        for _ in range(docs_per_replica):
            if rng.random() < 0.3:
                tokens = rng.choice(pool)
            else:
                tokens = [rng.randrange(50_000) for _ in range(BS * DOC_BLOCKS)]
            docs.append(tokens)
            hashes = [(counter + i).to_bytes(32, "big") for i in range(DOC_BLOCKS)]
            counter += DOC_BLOCKS
            event = kw.BlockStored(hashes, None, tokens, BS, None, "GPU", None)
            payloads.append((rid, kw.encode_batch(kw.KVEventBatch(time.time(), [event], 0))))
    return payloads, docs


def ingest(index: PrefixIndex, payloads, decode_only: bool = False) -> float:
    """CPU seconds of this (single-threaded) process: one core's work, whatever the load
    of the other cores of a shared machine."""
    started = time.process_time()
    for rid, payload in payloads:
        batch = kw.decode_batch(payload)
        if not decode_only:
            index.apply(rid, batch.events)
    return time.process_time() - started


def calibration_s() -> float:
    """Seconds for 10 million `s += i` in CPython: ~0.4 s on a quiet modern core."""
    started = time.process_time()
    s = 0
    for i in range(10_000_000):
        s += i
    return time.process_time() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(42)
    payloads, docs = make_payloads(args.replicas, args.blocks, rng)
    total_blocks = len(payloads) * DOC_BLOCKS

    # Ingest, apply + decode, each round on a fresh index.
    rates, apply_rates = [], []
    for _ in range(args.rounds):
        gc.collect()
        decode_s = ingest(PrefixIndex(), payloads, decode_only=True)
        index = PrefixIndex()
        gc.collect()
        seconds = ingest(index, payloads)
        rates.append(total_blocks / seconds)
        apply_rates.append(total_blocks / max(seconds - decode_s, 1e-9))
        del index

    # Memory of the index, traced.
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    ingest(index, payloads)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    bytes_per_block = held / total_blocks

    # Decisions over the same index.
    registry = Registry(lease_s=1e9)
    subscriber = KvEventSubscriber(index, clock=time.monotonic)
    decider = Decider(
        RoutingConfig(), registry, index=index, subscriber=subscriber, rng=random.Random(1)
    )
    registry.on_add.append(decider.replica_added)
    for r in range(args.replicas):
        rid = f"r{r}"
        registry.register(
            p.Register(
                rid,
                "m",
                f"http://{rid}",
                block_size=BS,
                kv_events_endpoint=f"tcp://127.0.0.1:{20000 + r}",
                kv_events_topic=rid,
            ),
            0.0,
        )
        registry.heartbeat(
            rid, p.ReplicaLoad(running=rng.randrange(8), waiting=rng.randrange(3),
                               kv_usage=rng.random()), 0.0,
        )  # fmt: skip
    prompts = []
    for i in range(1000):
        if i % 2:
            tokens = rng.choice(docs) + [rng.randrange(50_000) for _ in range(2048 - 320)]
        else:
            tokens = [rng.randrange(50_000) for _ in range(2048)]
        prompts.append(tokens)
    hash_times = []
    msgs = []
    for tokens in prompts:
        t0 = time.perf_counter()
        hashes = prompt_block_hashes(tokens, BS)
        hash_times.append(time.perf_counter() - t0)
        msgs.append(p.Route(1, "m", block_hashes=hashes, block_size=BS, prompt_tokens=len(tokens)))
    hits = 0
    lat = []
    cpu_started = time.process_time()
    for i in range(args.decisions):
        msg = msgs[i % len(msgs)]
        t0 = time.perf_counter()
        replica = decider.pick(msg, 0.0)
        lat.append(time.perf_counter() - t0)
        assert replica is not None
        hits += i % 2
        registry.released(replica.replica_id)
    cpu_per_decision = (time.process_time() - cpu_started) / args.decisions
    distinct = len(index)
    subscriber.close()  # (drops every replica from the index)
    lat.sort()
    result = {
        "replicas": args.replicas,
        "indexed_blocks": total_blocks,
        "distinct_block_hashes": distinct,
        "ingest_blocks_per_s_median": statistics.median(rates),
        "ingest_apply_only_blocks_per_s_median": statistics.median(apply_rates),
        "bytes_per_indexed_block": bytes_per_block,
        "decision_p50_us": lat[len(lat) // 2] * 1e6,
        "decision_p99_us": lat[int(len(lat) * 0.99)] * 1e6,
        "decision_cpu_mean_us": cpu_per_decision * 1e6,
        "request_hashing_2048_tokens_p50_us": statistics.median(hash_times) * 1e6,
        "calibration_loop_s": calibration_s(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "command": " ".join(["bench/router_cost.py", *sys.argv[1:]]),
    }
    out = ROOT / "bench" / "results" / "router_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| metric | value | goal |")
    print("|---|---|---|")
    print(f"| replicas / indexed blocks | {args.replicas} / {total_blocks:,} | 1,000 / 1,000,000 |")
    print(f"| decision p50 | {result['decision_p50_us']:.1f} us | < 100 us |")
    print(f"| decision p99 | {result['decision_p99_us']:.1f} us | |")
    print(f"| decision, mean CPU (incl. release) | {result['decision_cpu_mean_us']:.1f} us | |")
    print(f"| ingest (decode + index), median of {args.rounds} | "
          f"{result['ingest_blocks_per_s_median']:,.0f} blocks/s | >= 500,000 |")  # fmt: skip
    print(f"| ingest (index only) | {result['ingest_apply_only_blocks_per_s_median']:,.0f} "
          "blocks/s | |")  # fmt: skip
    print(f"| memory per indexed block | {bytes_per_block:.0f} B | <= 256 B |")
    print(f"| calibration: 10M-iteration Python loop | {result['calibration_loop_s']:.2f} s | |")
    print(f"| request hashing, 2,048 tokens | "
          f"{result['request_hashing_2048_tokens_p50_us']:.1f} us | |")  # fmt: skip


if __name__ == "__main__":
    main()
