"""Workloads for benchmarks: what requests arrive when, sent open loop, measured per request.

Build a workload (a list of ``RequestSpec`` with arrival times), then ``run_workload`` sends
each request at its time whatever the earlier ones are doing (open loop: a slow server
gets a queue, not fewer requests), streams the answer through the OpenAI chat API
(raw HTTP with aiohttp, ``stream_options.include_usage``) and measures per request:
TTFT (first content token), TPOT (time per output token after the first), end-to-end
latency, tokens and cached prompt tokens from the usage. ``summarize`` gives medians,
p90/p99 and goodput: the requests (and their rate) that met a TTFT and TPOT SLO.

Arrivals: ``poisson`` (exponential gaps) and ``bursty`` (gamma gaps with a coefficient of
variation above 1: the same mean rate in bursts). Lengths: ``Lengths`` (fixed, uniform or
lognormal, clipped). Named workloads (``WORKLOADS``):

- ``doc-extraction``: customers each with a long document family prefix (~3k tokens) and a
  short query per request; customers drawn with a Zipf skew.
- ``multi-turn``: chat sessions in which every turn repeats the whole conversation so far
  plus a new user message (the prefix grows turn by turn).
- ``system-prompt``: one shared system prompt and a random user question.
- ``random``: random prompts, nothing shared.

Prompt text is drawn from a word list and sized with ``count_tokens`` (the model's
tokenizer when given, so "3k tokens" means 3k of that model's tokens).

    from bench.workload import build, run_workload, summarize, SLO
    specs = build("doc-extraction", model="chat", rate=20, requests=200, seed=1)
    results = asyncio.run(
        run_workload(specs, "http://127.0.0.1:8000", model="chat", api_key="sk-...")
    )
    print(summarize(results, SLO(ttft_s=0.5, tpot_s=0.05)))
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# -- arrivals and lengths ---------------------------------------------------------------------


def poisson(rate: float, n: int, rng: random.Random) -> list[float]:
    """Arrival times (s) of ``n`` requests at ``rate`` per second, exponential gaps."""
    return bursty(rate, n, rng, cv=1.0)


def bursty(rate: float, n: int, rng: random.Random, cv: float = 3.0) -> list[float]:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation ``cv``
    (1 is Poisson; larger is burstier at the same mean rate)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0, got rate={rate}, cv={cv}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(shape, scale)
    return times


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``fixed``, ``uniform`` in [low, high], or ``lognormal`` with
    the given mean and sigma (of the log), clipped to [low, high]."""

    kind: str = "fixed"
    mean: int = 128
    low: int = 1
    high: int = 1 << 20
    sigma: float = 0.5

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = float(self.mean)
        elif self.kind == "uniform":
            value = rng.uniform(self.low, self.high)
        elif self.kind == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2
            value = rng.lognormvariate(mu, self.sigma)
        else:
            raise ValueError(f"Lengths.kind: {self.kind!r}; allowed: fixed, uniform, lognormal")
        return int(min(max(round(value), self.low), self.high))


# -- prompt text --------------------------------------------------------------------------------

_WORD_TEXT = (
    "invoice shipment consignee carrier freight pallet customs declaration weight volume "
    "port vessel container seal number date signature amount currency tax net gross total "
    "supplier buyer address street city country postal code contract clause liability "
    "insurance policy premium claim damage delivery route schedule warehouse inventory item "
    "quantity unit price discount payment terms bank account reference order confirmation"
)
WORDS = tuple(_WORD_TEXT.split())


def words_counter(text: str) -> int:
    return len(text.split())


def make_text(tokens: int, rng: random.Random, count_tokens: Callable[[str], int]) -> str:
    """Random words amounting to about ``tokens`` tokens by ``count_tokens``."""
    words = [rng.choice(WORDS) for _ in range(max(tokens, 1))]
    text = " ".join(words)
    measured = max(count_tokens(text), 1)
    keep = max(1, int(len(words) * tokens / measured))
    return " ".join(words[:keep])


# -- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    at_s: float  # arrival time from the start of the run
    messages: list[dict[str, str]]
    max_tokens: int
    group: str = ""  # the customer, session or "" (what shares a prefix)


@dataclass(frozen=True)
class WorkloadParams:
    model: str
    requests: int = 200
    rate: float = 10.0  # requests per second, mean
    burst_cv: float = 1.0  # 1: Poisson; > 1: bursty
    seed: int = 0
    output: Lengths = Lengths("lognormal", mean=64, low=4, high=512)
    query: Lengths = Lengths("lognormal", mean=48, low=8, high=256)
    document_tokens: int = 3000
    customers: int = 16
    zipf_s: float = 1.1
    sessions: int = 32
    turns: int = 6
    system_tokens: int = 1000
    prompt: Lengths = Lengths("lognormal", mean=512, low=16, high=4096)


def _arrivals(p: WorkloadParams, rng: random.Random) -> list[float]:
    return bursty(p.rate, p.requests, rng, cv=p.burst_cv)


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


def doc_extraction(p: WorkloadParams, count: Callable[[str], int]) -> list[RequestSpec]:
    rng = random.Random(p.seed)
    docs = [make_text(p.document_tokens, rng, count) for _ in range(p.customers)]
    weights = _zipf_weights(p.customers, p.zipf_s)
    specs = []
    for at in _arrivals(p, rng):
        c = rng.choices(range(p.customers), weights)[0]
        messages = [
            {"role": "system", "content": f"Customer {c} document family:\n{docs[c]}"},
            {"role": "user", "content": "Extract: " + make_text(p.query.draw(rng), rng, count)},
        ]
        specs.append(RequestSpec(at, messages, p.output.draw(rng), f"customer-{c}"))
    return specs


def multi_turn(p: WorkloadParams, count: Callable[[str], int]) -> list[RequestSpec]:
    """Sessions start at the arrival times; each session's turns follow one another with
    the same mean gap, and each turn carries the whole conversation so far."""
    rng = random.Random(p.seed)
    sessions = max(1, min(p.sessions, p.requests))
    starts = _arrivals(_with(p, requests=sessions), rng)
    specs: list[RequestSpec] = []
    per_session = -(-p.requests // sessions)
    gap = sessions / p.rate
    for s, start in enumerate(starts):
        history: list[dict[str, str]] = [{"role": "system", "content": "You are helpful."}]
        at = start
        for _turn in range(min(per_session, p.turns)):
            history = [
                *history,
                {"role": "user", "content": make_text(p.query.draw(rng), rng, count)},
            ]
            out = p.output.draw(rng)
            specs.append(RequestSpec(at, list(history), out, f"session-{s}"))
            # The next turn repeats the answer; the simulator's answer is filler of this size.
            history.append({"role": "assistant", "content": make_text(out, rng, count)})
            at += rng.expovariate(1.0 / gap)
    specs.sort(key=lambda r: r.at_s)
    return specs[: p.requests]


def system_prompt(p: WorkloadParams, count: Callable[[str], int]) -> list[RequestSpec]:
    rng = random.Random(p.seed)
    system = make_text(p.system_tokens, rng, count)
    return [
        RequestSpec(
            at,
            [
                {"role": "system", "content": system},
                {"role": "user", "content": make_text(p.query.draw(rng), rng, count)},
            ],
            p.output.draw(rng),
            "system",
        )
        for at in _arrivals(p, rng)
    ]


def random_prompts(p: WorkloadParams, count: Callable[[str], int]) -> list[RequestSpec]:
    rng = random.Random(p.seed)
    return [
        RequestSpec(
            at,
            [{"role": "user", "content": make_text(p.prompt.draw(rng), rng, count)}],
            p.output.draw(rng),
        )
        for at in _arrivals(p, rng)
    ]


def _with(p: WorkloadParams, **changes: Any) -> WorkloadParams:
    return WorkloadParams(**(asdict(p) | changes))


WORKLOADS: dict[str, Callable[[WorkloadParams, Callable[[str], int]], list[RequestSpec]]] = {
    "doc-extraction": doc_extraction,
    "multi-turn": multi_turn,
    "system-prompt": system_prompt,
    "random": random_prompts,
}


def build(
    name: str, *, count_tokens: Callable[[str], int] = words_counter, **params: Any
) -> list[RequestSpec]:
    """The named workload; ValueError naming the workloads when ``name`` is unknown."""
    make = WORKLOADS.get(name)
    if make is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    fields = WorkloadParams.__dataclass_fields__
    for key in ("output", "query", "prompt"):
        if isinstance(params.get(key), dict):
            params[key] = Lengths(**params[key])
    unknown = set(params) - set(fields)
    if unknown:
        raise ValueError(f"unknown workload parameter(s): {', '.join(sorted(unknown))}")
    return make(WorkloadParams(**params), count_tokens)


# -- running and measuring ------------------------------------------------------------------


@dataclass
class RequestResult:
    at_s: float
    group: str
    status: int = 0
    error: str = ""
    ttft_s: float = -1.0
    tpot_s: float = -1.0
    e2e_s: float = -1.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    lateness_s: float = 0.0  # how late the client sent it (a saturated client skews results)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.1


async def _one(
    session: Any, url: str, headers: dict[str, str], model: str, spec: RequestSpec, t0: float
) -> RequestResult:
    import aiohttp

    result = RequestResult(spec.at_s, spec.group)
    body = {
        "model": model,
        "messages": spec.messages,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result.lateness_s = start - (t0 + spec.at_s)
    token_times: list[float] = []
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.error = (await resp.text())[:200]
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        token_times.append(time.perf_counter())
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, TimeoutError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    end = time.perf_counter()
    result.e2e_s = end - start
    if token_times:
        result.ttft_s = token_times[0] - start
        n = max(result.completion_tokens, len(token_times))
        if n > 1:
            result.tpot_s = (end - token_times[0]) / (n - 1)
    else:
        result.error = "no tokens"
    return result


async def run_workload(
    specs: list[RequestSpec],
    base_url: str,
    *,
    model: str,
    api_key: str = "",
    timeout_s: float = 300.0,
    max_connections: int = 1024,
    keepalive_timeout_s: float = 15.0,
) -> list[RequestResult]:
    """Send every request at its arrival time (open loop) and measure each.
    keepalive_timeout_s: how long an idle connection is kept for the next request (aiohttp's
    default 15 s); below the server's own (uvicorn: 5 s) a sparse workload never sends on a
    connection the server is closing (ServerDisconnectedError)."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=keepalive_timeout_s)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def at_time(spec: RequestSpec) -> RequestResult:
            delay = t0 + spec.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await _one(session, url, headers, model, spec, t0)

        return list(await asyncio.gather(*(at_time(s) for s in specs)))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Summary:
    requests: int
    ok: int
    duration_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    e2e_p50_s: float
    e2e_p90_s: float
    goodput: float  # share of all requests that succeeded within the SLO
    goodput_rps: float
    output_tps: float
    cached_share: float  # cached prompt tokens / prompt tokens
    slo: dict[str, float] = field(default_factory=dict)


def summarize(results: list[RequestResult], slo: SLO) -> Summary:
    ok = [r for r in results if r.ok]
    if results:
        start = min(r.at_s for r in results)
        end = max(r.at_s + max(r.e2e_s, 0) for r in results)
    else:
        start = end = 0.0
    duration = max(end - start, 1e-9)
    good = [r for r in ok if r.ttft_s <= slo.ttft_s and r.tpot_s <= slo.tpot_s]
    prompt = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s >= 0]
    e2e = [r.e2e_s for r in ok]
    return Summary(
        requests=len(results),
        ok=len(ok),
        duration_s=duration,
        ttft_p50_s=percentile(ttft, 0.5),
        ttft_p90_s=percentile(ttft, 0.9),
        ttft_p99_s=percentile(ttft, 0.99),
        tpot_p50_s=percentile(tpot, 0.5),
        tpot_p90_s=percentile(tpot, 0.9),
        e2e_p50_s=percentile(e2e, 0.5),
        e2e_p90_s=percentile(e2e, 0.9),
        goodput=len(good) / len(results) if results else 0.0,
        goodput_rps=len(good) / duration,
        output_tps=sum(r.completion_tokens for r in ok) / duration,
        cached_share=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        slo={"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
