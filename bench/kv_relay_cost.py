"""The engine agent's KV-event relay: CPU per block on the node, and the router's side of it.

What runs, as in production but on one machine: vLLM's publisher (kv_wire.KVEventPublisher,
the same ZeroMQ PUB and wire format, on ipc:// in a 0700 directory) in this process; the
relay (engine_launch/kv_relay.py) in a process of its own, as the engine process's thread
would, forwarding to the router's KV relay socket over TCP loopback with CURVE; the router's
KvEventSubscriber (router/kv_subscriber.py) in this process, applying every batch to a
PrefixIndex. Each case publishes MESSAGES vLLM-format BlockStored batches of BLOCKS blocks
of 16 tokens, in chunks that the router takes in full before the next (no drops), and reads:

- the relay process's CPU (user + system from /proc, its libzmq I/O threads included, so
  the CURVE encryption counts) per block and per message: the agent's cost on the node;
- the router thread's CPU in `drain_relay` per block (receive, sequence check, decode,
  index), and the same with the router context's libzmq I/O thread (TCP and the CURVE
  decryption, on another core) added: the router's whole cost of the relayed path.

    .venv/bin/python bench/kv_relay_cost.py [--messages 20000] [--rounds 3] [--plain]

Medians over the rounds (each round a fresh relay process and router side). Prints a
markdown table and writes bench/results/kv_relay_cost.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BS = 16
CHUNK = 500  # messages published before the router drains them all


def _cpu_s(stat: str) -> float:
    """User + system CPU seconds from a /proc stat file (a process: all its threads)."""
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _tasks_cpu_s(tids: set[str]) -> float:
    return sum(_cpu_s(f"/proc/self/task/{tid}/stat") for tid in tids)


def relay_worker(events: str, replay: str, topic: str, router: str, curve_dir: str) -> None:
    from hpcserve.engine_launch.kv_relay import KvEventRelay

    relay = KvEventRelay(events, replay, topic, curve_dir=curve_dir)
    relay.start()
    relay.connect_router(router)
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    relay.stop()
    print(f"forwarded {relay.counts.forwarded} dropped {relay.counts.dropped}", flush=True)


def one_case(blocks: int, messages: int, plain: bool) -> dict[str, float]:
    import zmq

    from hpcserve.contracts import kv_wire as kw
    from hpcserve.contracts.curve import generate_keys, start_authenticator
    from hpcserve.router.kv_subscriber import KvEventSubscriber
    from hpcserve.router.prefix_index import PrefixIndex

    rng = random.Random(blocks)
    with tempfile.TemporaryDirectory(prefix="kv-relay-bench-") as tmp:
        keys = "" if plain else str(generate_keys(Path(tmp) / "curve"))
        private = Path(tmp) / "kv"
        private.mkdir(mode=0o700)
        events, replay = f"ipc://{private}/events", f"ipc://{private}/replay"
        # The router's side in a context of its own, whose libzmq I/O thread (the CURVE
        # decryption) is told apart from the publisher's by its thread ids.
        before = _tasks()
        ctx = zmq.Context()
        sub = KvEventSubscriber(PrefixIndex(), clock=time.monotonic, context=ctx)
        router_io = _tasks() - before
        auth = start_authenticator(ctx, Path(keys)) if keys else None
        pub_ctx = zmq.Context()
        pub = kw.KVEventPublisher(events, replay_endpoint=replay, topic="r1", context=pub_ctx)
        bound = sub.bind_relay("tcp://127.0.0.1:*", keys)
        sub.watch("r1", "", "", "r1", relayed=True)
        worker = subprocess.Popen(
            [sys.executable, __file__, "--relay-worker", events, replay, "r1", bound, keys],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        counter = [0]

        def batch() -> bytes:
            hashes = [(counter[0] + i).to_bytes(32, "big") for i in range(blocks)]
            counter[0] += blocks
            tokens = [rng.randrange(50_000) for _ in range(BS * blocks)]
            event = kw.BlockStored(hashes, None, tokens, BS, None, "GPU", None)
            return kw.encode_batch(kw.KVEventBatch(time.time(), [event], 0))

        def drain_until(seq: int) -> float:
            """Router-thread CPU seconds spent draining until batch `seq` is applied."""
            spent = 0.0
            stream = sub._streams[b"r1"]
            deadline = time.monotonic() + 120
            while stream.next_seq is None or stream.next_seq <= seq or stream.replaying:
                assert sub.relay is not None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router did not get batch {seq}")
                pub.service_replay()
                sub.relay.poll(5)
                started = time.thread_time()
                sub.drain_relay()
                spent += time.thread_time() - started
                sub.tick()
            return spent

        # Warm-up: the relay's subscription lands (PUB drops until then), the first batch's
        # replay from 0 is done.
        payloads = [batch() for _ in range(messages)]
        deadline = time.monotonic() + 60
        while sub._streams[b"r1"].next_seq is None and time.monotonic() < deadline:
            pub.publish([])
            drain_until_any = time.monotonic() + 0.05
            while time.monotonic() < drain_until_any and sub._streams[b"r1"].next_seq is None:
                pub.service_replay()
                assert sub.relay is not None
                sub.relay.poll(5)
                sub.drain_relay()
        drain_until(pub.next_seq - 1)
        relay_before = _cpu_s(f"/proc/{worker.pid}/stat")
        io_before = _tasks_cpu_s(router_io)
        router_thread = 0.0
        for start in range(0, messages, CHUNK):
            for payload in payloads[start : start + CHUNK]:
                seq = pub.next_seq
                pub._pub.send_multipart([b"r1", kw.encode_seq(seq), payload])
                pub._buffer.append((seq, payload))
                pub._seq += 1
            router_thread += drain_until(pub.next_seq - 1)
        relay_s = _cpu_s(f"/proc/{worker.pid}/stat") - relay_before
        router_s = router_thread + _tasks_cpu_s(router_io) - io_before
        assert worker.stdin is not None
        worker.stdin.close()
        tail = worker.stdout.read()
        worker.wait(30)
        resets = sum(m.samples[0].value for m in sub.metrics.resets.collect() if m.samples)
        sub.close()
        pub.close()
        if auth is not None:
            auth.stop()
        ctx.term()
        pub_ctx.term()
    total = messages * blocks
    return {
        "relay_us_per_block": relay_s / total * 1e6,
        "relay_us_per_message": relay_s / messages * 1e6,
        "router_thread_blocks_per_s": total / router_thread,
        "router_process_blocks_per_s": total / router_s,
        "resets": resets,
        "relay_tail": tail.strip(),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--relay-worker":
        relay_worker(*sys.argv[2:7])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", default="1,20,128", help="blocks per message, comma-separated")
    ap.add_argument("--plain", action="store_true", help="no CURVE (to see what it costs)")
    args = ap.parse_args()
    from bench.results import load_average, machine, write_results

    load_before = load_average()
    sizes = [int(b) for b in args.blocks.split(",")]
    rows = []
    for blocks in sizes:
        messages = max(args.messages * 20 // max(blocks, 20), 1000)
        rounds = [one_case(blocks, messages, args.plain) for _ in range(args.rounds)]
        row = {"blocks_per_message": blocks, "messages": messages, "rounds": rounds}
        for key in ("relay_us_per_block", "relay_us_per_message", "router_thread_blocks_per_s",
                    "router_process_blocks_per_s"):  # fmt: skip
            row[key] = statistics.median(r[key] for r in rounds)
        rows.append(row)
        print(f"{blocks} blocks/message done, load {load_average()}", file=sys.stderr)
    write_results("kv_relay_cost" + ("-plain" if args.plain else ""), {"rows": rows},
                  {"load_average_before": load_before})  # fmt: skip
    print(f"{machine()}; {'plain' if args.plain else 'CURVE'}; medians of {args.rounds} rounds;"
          f" load {load_before} before, {load_average()} after\n")  # fmt: skip
    print(
        "| blocks per message | messages | relay CPU per block | relay CPU per message | "
        "router thread (drain_relay) | router thread + its libzmq I/O thread |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['blocks_per_message']} | {row['messages']:,} | "
              f"{row['relay_us_per_block']:.2f} us | {row['relay_us_per_message']:.1f} us | "
              f"{row['router_thread_blocks_per_s']:,.0f} blocks/s | "
              f"{row['router_process_blocks_per_s']:,.0f} blocks/s |")  # fmt: skip


if __name__ == "__main__":
    main()
