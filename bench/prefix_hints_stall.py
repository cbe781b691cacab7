"""How long the gateway's event loop stalls while prompts are tokenized for prefix hints.

The gateway tokenizes a chat request's prompt (chat template + tokenizer) to give the
router its KV block hashes. On the event loop, a long prompt stops every other request for
as long as that takes. This measures, for prompts of several sizes, 8 requests at once:
the time to compute the hints and the event loop's longest stall (a 1 ms ticker's worst
lateness), with everything on the loop against the gateway's thread pool for long bodies.

    .venv/bin/python bench/prefix_hints_stall.py [--rounds 5]

Prints a markdown table and writes bench/results/prefix_hints_stall.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.config import GatewayConfig  # noqa: E402
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints  # noqa: E402
from hpcserve.gateway import app as gateway_app  # noqa: E402
from hpcserve.tinymodels import make_tiny_model  # noqa: E402

SIZES_KB = (1, 4, 16, 64)
AT_ONCE = 8


async def measure(gateway: gateway_app.Gateway, body: bytes) -> tuple[float, float]:
    """(wall ms for AT_ONCE hints at once, the loop's worst stall in ms)."""
    worst = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal worst
        loop = asyncio.get_running_loop()
        while not stop:
            before = loop.time()
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - before - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    results = await asyncio.gather(*(gateway.prefix_hints("m", body, {}) for _ in range(AT_ONCE)))
    wall = time.perf_counter() - started
    stop = True
    await tick
    assert all(r.get("block_hashes") for r in results), "no hints computed"
    return wall * 1000, worst * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model_dir = make_tiny_model("chat", Path(tempfile.mkdtemp(prefix="hints-")) / "chat")
    hints = RouteHints()
    # Prompt cache off: every round tokenizes its prompt (what is measured), none is a hit.
    hints.add_model("m", PromptTokenizer.from_dir(model_dir), 16, cache_bytes=0)
    gateway = gateway_app.Gateway(
        GatewayConfig(), routing_endpoint="tcp://127.0.0.1:9", configured_models={"m"}
    )
    gateway.route_hints = hints
    inline_limit = gateway_app.INLINE_HINT_BYTES
    load_before = os.getloadavg()
    rows = []
    for kb in SIZES_KB:
        text = "Bill of lading 4711: consignee ACME GmbH, Hamburg. " * (kb * 1024 // 52 + 1)
        body = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": text[: kb * 1024]}]}
        ).encode()
        runs: dict[str, list[tuple[float, float]]] = {"event loop": [], "thread pool": []}
        for _ in range(args.rounds):
            for mode in runs:
                gateway_app.INLINE_HINT_BYTES = 1 << 40 if mode == "event loop" else inline_limit
                runs[mode].append(asyncio.run(measure(gateway, body)))
        for mode, got in runs.items():
            wall = statistics.median(w for w, _ in got)
            stall = statistics.median(s for _, s in got)
            rows.append({"prompt_kb": kb, "where": mode, "wall_ms": wall, "worst_stall_ms": stall})
    gateway_app.INLINE_HINT_BYTES = inline_limit
    load_after = os.getloadavg()
    print(
        f"load average before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in load_after)}; {AT_ONCE} requests at once, medians of "
        f"{args.rounds}\n"
    )
    print("| prompt | tokenized on | hints for 8 requests | event loop's worst stall |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prompt_kb']} KB | {r['where']} | {r['wall_ms']:.1f} ms "
            f"| {r['worst_stall_ms']:.1f} ms |"
        )
    write_results(
        "prefix_hints_stall", {"rows": rows}, {"load_before": load_before, "load_after": load_after}
    )


if __name__ == "__main__":
    main()
