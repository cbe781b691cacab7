"""The gateway process's garbage collector, set for a server's allocation pattern.

Every relayed request allocates thousands of short-lived container objects (the decoded
JSON body, coroutines, futures, header lists, the prefix hints), most of them alive across
a few event-loop turns while up to hundreds of requests are in flight. With CPython's
default thresholds (700, 10, 10) that meant a young-generation collection every few
requests, each traversing every in-flight request's objects, and the oldest generation
traversing everything imported at start: ~30% of the gateway's CPU per request with
prefix hints on (docs/benchmarks.md, issue 23). At start, after the app is built, what
exists is collected once and frozen (never traversed again: modules, the tokenizer, the
config) and the young generation's threshold raised, so collections run about ten times
less often. Reference cycles are still collected; garbage lives a little longer.
"""

from __future__ import annotations

import gc

# Allocations (net of frees) between young-generation collections (CPython's default: 700).
GEN0_THRESHOLD = 7000


def tune_gc() -> None:
    """Collect, freeze what is left (the process's long-lived objects) and raise the young
    generation's threshold; call once, after start-up, before serving."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
