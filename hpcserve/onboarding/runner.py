"""Run a suite, and a short benchmark, against one served model through the gateway.

The suite's cases go through the official `openai` client (chat completions, or completions
for `prompt` cases), a few at a time, each answer scored by its checks (scorers.py). A
request that fails counts as an error and its checks score 0. The benchmark is bench/'s
workload generator (bench/workload.py, open loop, streamed) on a small stated workload,
measuring TTFT, TPOT and throughput as a client sees them.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcserve.modelcache.evaluations import Benchmark
from hpcserve.onboarding.scorers import metric_points, score
from hpcserve.onboarding.suite import Case, Suite


@dataclass
class CaseResult:
    id: str
    answer: str = ""
    error: str = ""
    finish_reason: str = ""
    checks: list[tuple[str, str, float]] = field(default_factory=list)  # metric, scorer, score


@dataclass
class SuiteRun:
    model: str
    results: list[CaseResult]
    scores: dict[str, float]  # every metric, points

    @property
    def errors(self) -> int:
        return sum(1 for r in self.results if r.error)

    def write_answers(self, path: Path) -> None:
        """One JSON line per case: its answer, error and check scores (for a person to read)."""
        with path.open("w") as out:
            for r in self.results:
                checks = [{"metric": m, "scorer": s, "score": v} for m, s, v in r.checks]
                line = {"id": r.id, "answer": r.answer, "error": r.error, "checks": checks}
                out.write(json.dumps({**line, "finish_reason": r.finish_reason}) + "\n")


def run_suite(
    suite: Suite,
    client: Any,  # openai.OpenAI
    model: str,
    *,
    concurrency: int = 4,
    say: Callable[[str], None] = lambda _: None,
) -> SuiteRun:
    """Every case of `suite` against `model`; scores per metric in points."""

    def one(case: Case) -> CaseResult:
        result = CaseResult(case.id)
        try:
            result.answer, result.finish_reason = _ask(client, model, case, suite)
        except Exception as err:  # openai.APIError and transport errors: the case failed
            result.error = f"{type(err).__name__}: {err}"[:500]
        for check in case.expect:
            value = 0.0 if result.error else score(check, result.answer, case, suite.custom)
            result.checks.append((check.metric, str(check.__struct_config__.tag), value))
        return result

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(one, suite.cases))
    failed = [r for r in results if r.error]
    if failed:
        say(f"{len(failed)} of {len(results)} cases failed, e.g. {failed[0].id}: {failed[0].error}")
    scores = metric_points((m, v) for r in results for m, _s, v in r.checks)
    return SuiteRun(model, results, {m: scores.get(m, 0.0) for m in suite.metrics})


def _ask(client: Any, model: str, case: Case, suite: Suite) -> tuple[str, str]:
    params = suite.case_params(case).kwargs()
    extra_body = params.pop("extra_body", None) or {}
    if case.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in case.messages]
        reply = client.chat.completions.create(
            model=model, messages=messages, extra_body=extra_body or None, **params
        )
        choice = reply.choices[0]
        return choice.message.content or "", choice.finish_reason or ""
    # The completions API has no response_format argument in the client; vLLM takes it.
    if "response_format" in params:
        extra_body = {**extra_body, "response_format": params.pop("response_format")}
    reply = client.completions.create(
        model=model, prompt=case.prompt, extra_body=extra_body or None, **params
    )
    choice = reply.choices[0]
    return choice.text or "", choice.finish_reason or ""


@dataclass(frozen=True)
class BenchSpec:
    """The stated workload of a version's benchmark (bench/workload.py's generator)."""

    workload: str = "doc-extraction"
    requests: int = 24
    rate: float = 2.0  # requests per second, Poisson arrivals
    prompt_tokens: int = 256  # the document / system prompt / prompt, in the model's tokens
    output_tokens: int = 32
    seed: int = 0

    def describe(self) -> str:
        return (
            f"{self.workload}: {self.requests} requests, Poisson {self.rate:g}/s, "
            f"{self.prompt_tokens}-token prompt part, {self.output_tokens} output tokens, "
            f"seed {self.seed}, streamed through the gateway"
        )


def benchmark(
    spec: BenchSpec, base_url: str, api_key: str, model: str, *, tokenizer: str = ""
) -> Benchmark:
    """Run the stated workload against `model` (`base_url`: the gateway, without /v1).
    `tokenizer`: a tokenizer.json, so token counts are the model's own."""
    try:
        # bench/ is the source tree's, not the installed package's (so not type-checked).
        from bench.workload import (  # type: ignore[import-not-found,unused-ignore]
            SLO,
            Lengths,
            build,
            run_workload,
            summarize,
            words_counter,
        )
    except ImportError:
        raise RuntimeError(
            "the benchmark uses bench/workload.py from hpcserve's source tree: run from it, "
            "or pass --no-bench"
        ) from None
    count = words_counter
    if tokenizer and Path(tokenizer).is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer)

        def count(text: str) -> int:
            return len(tok.encode(text, add_special_tokens=False).ids)

    fixed = Lengths("fixed", mean=spec.output_tokens)
    specs = build(
        spec.workload,
        count_tokens=count,
        model=model,
        requests=spec.requests,
        rate=spec.rate,
        seed=spec.seed,
        output=fixed,
        query=Lengths("fixed", mean=16),
        prompt=Lengths("fixed", mean=spec.prompt_tokens),
        document_tokens=spec.prompt_tokens,
        system_tokens=spec.prompt_tokens,
        customers=4,
    )
    results = asyncio.run(run_workload(specs, base_url, model=model, api_key=api_key))
    s = summarize(results, SLO())
    return Benchmark(
        workload=spec.describe(),
        requests=s.requests,
        ok=s.ok,
        duration_s=_finite(s.duration_s, 3),
        ttft_p50_s=_finite(s.ttft_p50_s, 4),
        ttft_p90_s=_finite(s.ttft_p90_s, 4),
        tpot_p50_s=_finite(s.tpot_p50_s, 4),
        tpot_p90_s=_finite(s.tpot_p90_s, 4),
        output_tokens_per_s=_finite(s.output_tps, 2),
        requests_per_s=_finite(s.ok / s.duration_s, 3) if s.duration_s else 0.0,
    )


def _finite(value: float, digits: int) -> float:
    """Rounded; -1 where nothing was measured (no request succeeded)."""
    return round(value, digits) if math.isfinite(value) else -1.0
