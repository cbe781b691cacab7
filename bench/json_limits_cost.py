"""What the gateway's raw-body bounds cost per request (gateway/json_limits.py `check_body`),
the compiled pass (gateway/_json_scan.c) beside the check it replaced (one `bytes.translate`
of the body into three classes, a count of opening brackets, a search for 19 digits, and
for a body with many brackets or such a run anywhere, a vectorised look outside its
strings), each up to its verdict (the field-naming decode after it is the same), in one
process, interleaved.

The bodies: bench/proxy_overhead.py's chat bodies (1k-4k-token multi-turn conversations,
5-14 KB of JSON, as the gateway's overhead benchmark sends them), and adversarial 1 MB
bodies for the worst case (escape after escape in one string, escaped quotes, nesting,
a run of digits), whose figures are for one call each.

    .venv/bin/python bench/json_limits_cost.py [--rounds 7] [--number 20000]

Prints a markdown table and writes bench/results/json_limits_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proxy_overhead import chat_body, chat_conversations  # noqa: E402
from bench.results import write_results  # noqa: E402
from hpcserve.gateway import json_limits  # noqa: E402

ADVERSARIAL = {
    "1 MB: 500,000 escapes in one string": b'{"a":"' + b"\\n" * 500_000 + b'"}',
    "1 MB: 500,000 escaped quotes": b'{"a":"' + b'\\"' * 500_000 + b'"}',
    "1 MB: a million opening brackets": b"[" * 1_000_000,
    "1 MB: a million digits": b"[" + b"1" * 1_000_000 + b"]",
}


def translate_check(body: bytes) -> bool:
    """The previous check up to its verdict: the classes, then the closer look (outside
    strings, vectorised) for a body with many brackets or a run of 19 digits anywhere."""
    shape = body.translate(json_limits._CLASSES)
    too_deep = long_number = False
    if shape.count(b"[") > json_limits.MAX_DEPTH:
        too_deep = json_limits.nesting_depth(body) > json_limits.MAX_DEPTH
    if json_limits._LONG_NUMBER in shape:
        outside = json_limits._outside_strings(body).translate(json_limits._CLASSES)
        long_number = json_limits._LONG_NUMBER in outside
    return too_deep or long_number


def compiled_check(body: bytes) -> bool:
    depth, long_number = json_limits._json_scan.scan(body)
    return depth > json_limits.MAX_DEPTH or long_number


def per_call_us(check: Callable[[bytes], bool], bodies: list[bytes], number: int) -> float:
    """CPU microseconds per call, over `number` calls cycling through `bodies`."""
    calls = [bodies[i % len(bodies)] for i in range(number)]
    start = time.process_time()
    for body in calls:
        check(body)
    return (time.process_time() - start) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args()

    bodies = [chat_body(messages, stream=False) for messages in chat_conversations()]
    sizes = sorted(len(b) for b in bodies)
    rows = []
    previous, compiled = [], []
    for _ in range(args.rounds):  # interleaved: both see the same moments of the machine
        previous.append(per_call_us(translate_check, bodies, args.number))
        compiled.append(per_call_us(compiled_check, bodies, args.number))
    rows.append(
        {
            "bodies": f"chat bodies, {sizes[0] / 1024:.1f}-{sizes[-1] / 1024:.1f} KB "
            f"(median {statistics.median(sizes) / 1024:.1f} KB)",
            "translate_us": round(statistics.median(previous), 2),
            "compiled_us": round(statistics.median(compiled), 2),
        }
    )
    for name, body in ADVERSARIAL.items():
        assert json_limits._json_scan.scan(body) == json_limits.scan_reference(body), name
        before = min(timeit.repeat(lambda b=body: translate_check(b), number=1, repeat=5))
        after = min(timeit.repeat(lambda b=body: compiled_check(b), number=1, repeat=5))
        rows.append(
            {"bodies": name, "translate_us": round(before * 1e6), "compiled_us": round(after * 1e6)}
        )
    for row in rows:
        row["ratio"] = round(row["translate_us"] / row["compiled_us"], 1)
    print("| bodies | previous check (classes, count, search, closer look) | compiled | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['bodies']} | {row['translate_us']} us | {row['compiled_us']} us | "
            f"{row['ratio']}x |"
        )
    path = write_results(
        "json_limits_cost", {"rows": rows}, {"rounds": args.rounds, "number": args.number}
    )
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
