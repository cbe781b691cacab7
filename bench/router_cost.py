"""Router cost at fleet scale: decision latency, KV-event ingest rate, memory per block.

One process, one core, no network in the measured paths:
- ingest: vLLM-format KV-event payloads (msgpack, the 0.32 map layout) for REPLICAS
  replicas holding BLOCKS indexed blocks in all (some prefixes shared between replicas),
  decoded and applied to the PrefixIndex; blocks/s with and without the decode; and the
  same payloads through KvEventSubscriber from ZeroMQ inproc sockets (its whole path);
- memory: tracemalloc's count of the bytes the index holds, per indexed (replica, block);
- decision: Decider.pick (prefix match + filters + scorers + picker + bookkeeping) for
  2,048-token prompts (128 blocks of 16), half of them starting with an indexed document;
  p50/p99 over DECISIONS; also the request-side hashing of such a prompt.

    .venv/bin/python bench/router_cost.py [--replicas 1000] [--blocks 1000000]
        [--rounds 3] [--baseline GIT_REV]

Each round runs in a fresh worker process (this script with --worker). With --baseline,
every round also runs the same measurements against the code of GIT_REV (exported with
`git archive` to a temporary directory, imported instead of the working tree),
interleaved with the current code's, so both sides see the same machine load. Figures are
medians over the rounds. Prints a markdown table and writes bench/results/router_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--code" in sys.argv:  # a worker measuring another revision: its packages come first
    sys.path.insert(0, sys.argv[sys.argv.index("--code") + 1])
else:
    sys.path.insert(0, str(ROOT))

from hpcserve.config import RoutingConfig  # noqa: E402
from hpcserve.contracts import kv_wire as kw  # noqa: E402
from hpcserve.contracts import protocol as p  # noqa: E402
from hpcserve.contracts.prefix_hash import prompt_block_hashes  # noqa: E402
from hpcserve.router.decide import Decider  # noqa: E402
from hpcserve.router.kv_subscriber import KvEventSubscriber  # noqa: E402
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


# What the router's subscriber decodes with (token_ids left as raw msgpack for the compiled
# hash); a revision from before it had only decode_batch.
decode_for_index = getattr(kw, "decode_batch_raw_tokens", kw.decode_batch)


def ingest(index: PrefixIndex, payloads, decode_only: bool = False) -> float:
    """CPU seconds of this (single-threaded) process: one core's work, whatever the load
    of the other cores of a shared machine."""
    decode = decode_for_index
    started = time.process_time()
    for rid, payload in payloads:
        batch = decode(payload)
        if not decode_only:
            index.apply(rid, batch.events)
    return time.process_time() - started


def ingest_via_subscriber(payloads, replicas: int) -> float:
    """CPU seconds for KvEventSubscriber to take every payload off its SUB socket and apply
    it (receive, sequence check, decode, index, metrics): the router's whole ingest path.
    One inproc PUB per replica (no I/O thread); everything is queued before the clock
    starts, so the publishers' work is not counted."""
    import zmq

    ctx = zmq.Context()
    subscriber = KvEventSubscriber(PrefixIndex(), clock=time.monotonic, context=ctx)
    pubs = {}
    for r in range(replicas):
        rid = f"r{r}"
        pubs[rid] = ctx.socket(zmq.PUB)
        pubs[rid].set_hwm(0)
        pubs[rid].bind(f"inproc://kv-{rid}")
        subscriber.watch(rid, f"inproc://kv-{rid}", "", rid)
    time.sleep(0.5)  # the subscriptions reach the publishers
    seqs = dict.fromkeys(pubs, 0)
    for rid, payload in payloads:
        pubs[rid].send_multipart([rid.encode(), kw.encode_seq(seqs[rid]), payload])
        seqs[rid] += 1
    gc.collect()
    handled = 0
    started = time.process_time()
    while handled < len(payloads):
        got = subscriber.drain(100_000)
        if not got:
            raise RuntimeError(f"the subscriber got {handled} of {len(payloads)} messages")
        handled += got
    seconds = time.process_time() - started
    if subscriber.metrics.bad._value.get() or subscriber.index.orphans:
        raise RuntimeError("the subscriber refused messages")
    subscriber.close()
    for pub in pubs.values():
        pub.close(0)
    ctx.term()
    return seconds


def ingest_via_relay(payloads, replicas: int) -> float | None:
    """The same through the KV relay socket engines' agents connect to (a ROUTER; the
    agents' frames behind their routing id, drained by `drain_relay`): one inproc DEALER
    per replica, as each engine's agent connects (CURVE does not apply to inproc: its
    decryption runs on libzmq's I/O thread, bench/kv_relay_cost.py measures it)."""
    import zmq

    if not hasattr(KvEventSubscriber, "drain_relay"):  # a revision from before the relay
        return None
    ctx = zmq.Context()
    subscriber = KvEventSubscriber(PrefixIndex(), clock=time.monotonic, context=ctx)
    subscriber.bind_relay("inproc://kv-relay")
    agents = {}
    for r in range(replicas):
        rid = f"r{r}"
        agents[rid] = ctx.socket(zmq.DEALER)
        agents[rid].set_hwm(0)
        agents[rid].setsockopt(zmq.ROUTING_ID, rid.encode())
        agents[rid].connect("inproc://kv-relay")
        subscriber.watch(rid, "", "", rid, relayed=True)
        # In step already (a stream's first message would otherwise ask its agent for a
        # replay from 0, and these agents do not answer): the steady state is measured.
        subscriber._streams[rid.encode()].next_seq = 0
    seqs = dict.fromkeys(agents, 0)
    for rid, payload in payloads:
        agents[rid].send_multipart([rid.encode(), kw.encode_seq(seqs[rid]), payload])
        seqs[rid] += 1
    gc.collect()
    handled = 0
    started = time.process_time()
    while handled < len(payloads):
        got = subscriber.drain_relay(100_000)
        if not got:
            raise RuntimeError(f"the relay socket got {handled} of {len(payloads)} messages")
        handled += got
    seconds = time.process_time() - started
    if subscriber.metrics.bad._value.get() or subscriber.index.orphans:
        raise RuntimeError("the subscriber refused relayed messages")
    if subscriber.metrics.ingest.batches != len(payloads):
        raise RuntimeError(
            f"{subscriber.metrics.ingest.batches} of {len(payloads)} relayed batches applied"
        )
    subscriber.close()
    for agent in agents.values():
        agent.close(0)
    ctx.term()
    return seconds


def calibration_s() -> float:
    """Seconds for 10 million `s += i` in CPython: ~0.4 s on a quiet modern core."""
    started = time.process_time()
    s = 0
    for i in range(10_000_000):
        s += i
    return time.process_time() - started


def measure(args: argparse.Namespace) -> dict:
    """One round in this process: ingest (decode + index, and decode alone), the index's
    memory (with --memory), decisions."""
    rng = random.Random(42)
    payloads, docs = make_payloads(args.replicas, args.blocks, rng)
    total_blocks = len(payloads) * DOC_BLOCKS

    gc.collect()
    decode_s = ingest(PrefixIndex(), payloads, decode_only=True)
    index = PrefixIndex()
    gc.collect()
    seconds = ingest(index, payloads)
    result = {
        "ingest_blocks_per_s": total_blocks / seconds,
        "ingest_apply_only_blocks_per_s": total_blocks / max(seconds - decode_s, 1e-9),
    }
    del index
    gc.collect()
    result["ingest_subscriber_blocks_per_s"] = total_blocks / ingest_via_subscriber(
        payloads, args.replicas
    )
    gc.collect()
    relay_s = ingest_via_relay(payloads, args.replicas)
    if relay_s is not None:
        result["ingest_relay_blocks_per_s"] = total_blocks / relay_s

    if args.memory:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        ingest(index, payloads)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        result["bytes_per_indexed_block"] = held / total_blocks
        del index

    # Decisions over a freshly built index.
    index = PrefixIndex()
    ingest(index, payloads)
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
    lat = []
    cpu_started = time.process_time()
    for i in range(args.decisions):
        msg = msgs[i % len(msgs)]
        t0 = time.perf_counter()
        replica = decider.pick(msg, 0.0)
        lat.append(time.perf_counter() - t0)
        assert replica is not None
        registry.released(replica.replica_id)
        if hasattr(decider, "record_routed"):  # after the reply, as the server does it
            decider.record_routed()
    cpu_per_decision = (time.process_time() - cpu_started) / args.decisions
    distinct = len(index)
    subscriber.close()  # (drops every replica from the index)
    cold, doc = sorted(lat[0::2]), sorted(lat[1::2])  # prompts alternate: cold, document
    lat.sort()
    result.update(
        indexed_blocks=total_blocks,
        distinct_block_hashes=distinct,
        decision_p50_us=lat[len(lat) // 2] * 1e6,
        decision_p99_us=lat[int(len(lat) * 0.99)] * 1e6,
        decision_cold_prompt_p50_us=cold[len(cold) // 2] * 1e6,
        decision_document_prompt_p50_us=doc[len(doc) // 2] * 1e6,
        decision_cpu_mean_us=cpu_per_decision * 1e6,
        request_hashing_2048_tokens_p50_us=statistics.median(hash_times) * 1e6,
    )
    return result


def export_revision(rev: str, into: Path) -> Path:
    """GIT_REV's packages laid out as an importable tree (`hpcserve/router/...`, as the
    editable install maps them); the working tree and the index are not touched."""
    tree = into / "tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    if (tree / "setup.py").exists():  # its compiled part (contracts/_blockhash.c), built in place
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            check=True,
            capture_output=True,
        )
    site = into / "site"
    site.mkdir()
    pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    package_dirs = pyproject["tool"]["setuptools"]["package-dir"]
    shutil.move(tree / package_dirs["hpcserve"], site / "hpcserve")
    for package, folder in package_dirs.items():
        if package != "hpcserve" and (tree / folder).is_dir():
            shutil.move(tree / folder, site / package.replace(".", "/"))
    return site


def run_worker(args: argparse.Namespace, code: Path | None, memory: bool) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    argv += ["--replicas", str(args.replicas), "--blocks", str(args.blocks)]
    argv += ["--decisions", str(args.decisions)]
    if memory:
        argv.append("--memory")
    if code is not None:
        argv += ["--code", str(code)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def median_of(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds if key in r)


def summarize(rounds: list[dict]) -> dict:
    keys = [k for k in rounds[0] if k not in ("indexed_blocks", "distinct_block_hashes")]
    out = {k: median_of(rounds, k) for k in keys}
    if any("bytes_per_indexed_block" in r for r in rounds):
        out["bytes_per_indexed_block"] = median_of(rounds, "bytes_per_indexed_block")
    out["rounds"] = rounds
    return out


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


ROWS = [
    ("decision p50", "decision_p50_us", "{:.1f} us", "< 100 us"),
    ("decision p99", "decision_p99_us", "{:.1f} us", ""),
    ("decision p50, cold prompts (no cached prefix)", "decision_cold_prompt_p50_us",
     "{:.1f} us", ""),
    ("decision p50, prompts opening with an indexed document",
     "decision_document_prompt_p50_us", "{:.1f} us", ""),
    ("decision, mean CPU (incl. release)", "decision_cpu_mean_us", "{:.1f} us", ""),
    ("ingest (decode + index)", "ingest_blocks_per_s", "{:,.0f} blocks/s", ">= 500,000"),
    ("ingest (index only)", "ingest_apply_only_blocks_per_s", "{:,.0f} blocks/s", ""),
    ("ingest through KvEventSubscriber (ZeroMQ inproc: receive + decode + index + metrics)",
     "ingest_subscriber_blocks_per_s", "{:,.0f} blocks/s", ""),
    ("ingest through the KV relay socket (agents' DEALERs, inproc; drain_relay)",
     "ingest_relay_blocks_per_s", "{:,.0f} blocks/s", ">= 500,000"),
    ("memory per indexed block", "bytes_per_indexed_block", "{:.0f} B", "<= 256 B"),
    ("request hashing, 2,048 tokens", "request_hashing_2048_tokens_p50_us", "{:.1f} us", ""),
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default="", help="a git revision to measure side by side")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--code", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return

    load_before = load_average()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="router-cost-") as tmp:
        baseline_code = export_revision(args.baseline, Path(tmp)) if args.baseline else None
        current: list[dict] = []
        baseline: list[dict] = []
        for r in range(args.rounds):
            if baseline_code is not None:
                baseline.append(run_worker(args, baseline_code, memory=r == 0))
            current.append(run_worker(args, None, memory=r == 0))
            print(f"round {r + 1}/{args.rounds} done, load {load_average()}", file=sys.stderr)
    result = {
        "replicas": args.replicas,
        "indexed_blocks": current[0]["indexed_blocks"],
        "distinct_block_hashes": current[0]["distinct_block_hashes"],
        "current": summarize(current),
        "baseline_revision": args.baseline or None,
        "baseline": summarize(baseline) if baseline else None,
        "calibration_loop_s": calibration_s(),
        "load_average_1_5_15_before": load_before,
        "load_average_1_5_15_after": load_average(),
        "wall_s": round(time.time() - started, 1),
    }
    from bench.results import write_results  # here: a --code worker runs another revision

    write_results("router_cost", result)
    cur, base = result["current"], result["baseline"]
    print(f"{args.replicas} replicas, {result['indexed_blocks']:,} indexed blocks; medians of "
          f"{args.rounds} rounds; load average {load_before} before, "
          f"{result['load_average_1_5_15_after']} after\n")  # fmt: skip
    head = (
        f"| metric | {args.baseline} (before) | now | goal |" if base else "| metric | now | goal |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for label, key, fmt, goal in ROWS:
        now = fmt.format(cur[key]) if key in cur else "n/a"
        before = fmt.format(base[key]) if base and key in base else "n/a"
        print(f"| {label} | {before} | {now} | {goal} |" if base
              else f"| {label} | {now} | {goal} |")  # fmt: skip
    print(f"| calibration: 10M-iteration Python loop | {result['calibration_loop_s']:.2f} s | |")


if __name__ == "__main__":
    main()
