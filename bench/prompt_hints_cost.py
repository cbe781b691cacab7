"""What the gateway's prefix hints cost per chat request, by what the prompt cache holds,
with the tokenizers library's own thread pool on (its default, as the gateway runs) and off
(TOKENIZERS_PARALLELISM=false), side by side in one process.

The hint path as the gateway runs it for a request (gateway/app.py `prefix_hints`): find
the body's messages (the compiled `message_spans`), walk the prompt cache with their bytes'
keys (gateway/route_hints.py `body_hints`, `RouteHints.plan_body`: a message it does not
hold is decoded), render and tokenize
what it does not hold and hash the blocks (`HintsPlan.run`), encode the Route; all on the
calling thread
(the gateway hands more than 2,048 new characters to its thread pool: the same CPU). The
bodies are bench/proxy_overhead.py's (its 32k-entry byte-level BPE tokenizer, Llama-3 chat
template, 16 conversations of 1k-4k tokens over 4 system prompts); the cases:

- repeat: a conversation sent before (everything cached);
- new question: the last user turn is new (short: deferred, not tokenized);
- new turn: the previous answer (80-120 words, never seen) and a new question: the answer is
  rendered and tokenized, as every turn of a real multi-turn chat needs;
- cold: the prompt cache off (every request rendered and tokenized whole).

    .venv/bin/python bench/prompt_hints_cost.py [--rounds 5] [--requests 400]

Prints a markdown table and writes bench/results/prompt_hints_cost.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from bench.proxy_overhead import (  # noqa: E402
    COUNTER,
    MODEL,
    _Text,
    bench_model_dir,
    chat_conversations,
)
from bench.results import write_results  # noqa: E402
from hpcserve.config import GatewayConfig  # noqa: E402
from hpcserve.contracts import protocol as p  # noqa: E402
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints, hash_stride  # noqa: E402
from hpcserve.gateway.route_hints import body_hints  # noqa: E402

BLOCK_SIZE = 16
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"  # read by the tokenizers library at every call
CASES = ("repeat", "new question", "new turn", "cold")


def hints_for(tokenizer: PromptTokenizer, cache: bool) -> RouteHints:
    gateway = GatewayConfig()
    hints = RouteHints()
    hints.add_model(
        MODEL,
        tokenizer,
        BLOCK_SIZE,
        gateway.prompt_cache_mb << 20 if cache else 0,
        gateway.prompt_defer_chars,
        hash_stride(gateway.prefix_hash_tokens, BLOCK_SIZE),
    )
    return hints


def request_maker(case: str, answers: list[str]) -> Callable[[int], bytes]:
    """Request number -> its body for `case` (numbers are never reused within a run)."""
    conversations = chat_conversations()

    def body(i: int) -> bytes:
        messages = [dict(m) for m in conversations[i % len(conversations)]]
        question = messages[-1]["content"]
        if case == "repeat":
            messages[-1]["content"] = question.replace(COUNTER, "0")
        else:
            messages[-1]["content"] = question.replace(COUNTER, str(i))
        if case == "new turn":
            answer = {"role": "assistant", "content": f"Answer {i}: {answers[i % len(answers)]}"}
            messages.insert(-1, answer)
        return msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 64})

    return body


def measure(hints: RouteHints, bodies: list[bytes], first: int) -> tuple[float, float]:
    """(CPU us, wall us) per request over `bodies`: scan, plan, run, Route encode."""
    wall, cpu = time.perf_counter(), time.process_time()
    for n, body in enumerate(bodies):
        fields = body_hints(hints, MODEL, body, {})
        p.encode(p.Route(first + n, MODEL, **fields))
    count = len(bodies)
    return (time.process_time() - cpu) / count * 1e6, (time.perf_counter() - wall) / count * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400, help="per case, round and setting")
    args = ap.parse_args()
    load_before = os.getloadavg()
    tokenizer = PromptTokenizer.from_dir(bench_model_dir(Path(tempfile.gettempdir())))
    text = _Text(seed=31)
    answers = [text.sentences(int(text.rng.integers(80, 121))) for _ in range(64)]
    cached, uncached = hints_for(tokenizer, True), hints_for(tokenizer, False)
    makers = {case: request_maker(case, answers) for case in CASES}
    settings = {"pool on (default)": "true", "pool off": "false"}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    number = 1_000_000
    for i in range(64):  # the repeated conversations, cached once
        body_hints(cached, MODEL, makers["repeat"](i), {})
    for round_ in range(args.rounds):
        for case in CASES:
            for label, value in settings.items():
                os.environ[PARALLELISM_ENV] = value
                bodies = [makers[case](number + k) for k in range(args.requests)]
                hints = uncached if case == "cold" else cached
                samples.setdefault((case, label), []).append(measure(hints, bodies, number))
                number += args.requests
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for case in CASES:
        row: dict[str, Any] = {"case": case}
        for label in settings:
            cpu = statistics.median(s[0] for s in samples[(case, label)])
            wall = statistics.median(s[1] for s in samples[(case, label)])
            row[label] = {"cpu_us": round(cpu, 1), "wall_us": round(wall, 1)}
        row["cpu on / off"] = round(
            row["pool on (default)"]["cpu_us"] / row["pool off"]["cpu_us"], 2
        )
        rows.append(row)
    print("| case | CPU, pool on (default) | CPU, pool off | on / off | wall on / off |")
    print("|---|---|---|---|---|")
    for row in rows:
        on, off = row["pool on (default)"], row["pool off"]
        print(
            f"| {row['case']} | {on['cpu_us']:,.0f} us | {off['cpu_us']:,.0f} us | "
            f"{row['cpu on / off']}x | {on['wall_us']:,.0f} / {off['wall_us']:,.0f} us |"
        )
    write_results(
        "prompt_hints_cost",
        {"rows": rows},
        {
            "load_average_before": [round(x, 2) for x in load_before],
            "rounds": args.rounds,
            "requests": args.requests,
            "block_size": BLOCK_SIZE,
        },
    )


if __name__ == "__main__":
    main()
