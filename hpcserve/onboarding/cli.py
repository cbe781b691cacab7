"""`hpcserve models eval REF --suite FILE [--baseline REF]`: evaluate a version, compare it
with a baseline version through the parity gate, and record the result in the registry.

Each version is evaluated the same way, one after the other (so one engine runs at a time
when they are started for it): find a replica serving it (replica.py), or start one as a
Slurm job of the canary pool `--pool`; run the suite through the gateway with the official
openai client; for the candidate, run the benchmark and read the engine's version; drain the
job if it was started here. The candidate's scores go through the gate (gate.py) with its
model's rule (`hpcserve models gate`), and the evaluation is recorded for the candidate
version: `hpcserve models show NAME@N` shows it, and `alias`/`promote` then allow it.

A candidate that passes gets its numerical canaries' golden record (modelcache/canary.py
`record_canary`) decoded on the replica that ran the eval, before that replica is drained,
so every replica of the version is then checked against it (before registering and
periodically). A version that already has a record keeps it; a record that cannot be made
(an engine without logprobs) leaves the verdict as it is and says how to record by hand.

Exit codes: 0 the version passed its gate, 1 it failed, 2 the evaluation could not be run.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcserve.config import PlatformConfig, config_path, load_config
from hpcserve.modelcache.evaluations import Benchmark, Evaluation, MetricResult
from hpcserve.modelcache.registry import Registry, RegistryError
from hpcserve.onboarding.gate import judge
from hpcserve.onboarding.runner import BenchSpec, SuiteRun, benchmark, run_suite
from hpcserve.onboarding.scorers import ScorerError
from hpcserve.onboarding.suite import Suite, SuiteError, load_suite

if TYPE_CHECKING:
    from hpcserve.onboarding.replica import Target

log = logging.getLogger(__name__)
Say = Callable[[str], None]


def add_eval_parser(models_subparsers: Any) -> None:
    p = models_subparsers.add_parser(
        "eval", help="run an eval suite against a version, gate it against a baseline"
    )
    p.add_argument("ref", help="NAME@VERSION to evaluate")
    p.add_argument("--suite", required=True, metavar="FILE", help="eval suite (JSONL)")
    p.add_argument("--baseline", metavar="REF", help="version (or alias) to compare with")
    p.add_argument(
        "--config",
        help="platform config (TOML); default $HPCSERVE_CONFIG or .state/hpcserve.toml",
    )
    p.add_argument(
        "--pool",
        metavar="POOL",
        help="canary pool: where no replica serves a version, start one as a Slurm job of "
        "this configured pool's shape (drained when done)",
    )
    p.add_argument(
        "--gateway",
        metavar="URL",
        help="the gateway's base URL (default: the config's gateway host and port)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        default=os.environ.get("HPCSERVE_API_KEY_FILE", ""),
        help="file holding the API key for the gateway (default: $HPCSERVE_API_KEY_FILE, "
        "else $HPCSERVE_API_KEY)",
    )
    p.add_argument("--answers", metavar="FILE", help="write the candidate's answers (JSONL)")
    p.add_argument("--concurrency", type=int, default=4, metavar="N", help="cases in flight")
    p.add_argument(
        "--start-timeout", type=float, default=900.0, metavar="S", help="for a canary job"
    )
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    p.add_argument(
        "--no-canary",
        action="store_true",
        help="do not record the version's golden record (numerical canaries) when it passes",
    )
    spec = BenchSpec()
    p.add_argument("--bench-workload", default=spec.workload, metavar="NAME")
    p.add_argument("--bench-requests", type=int, default=spec.requests, metavar="N")
    p.add_argument("--bench-rate", type=float, default=spec.rate, metavar="RPS")
    p.add_argument("--bench-prompt-tokens", type=int, default=spec.prompt_tokens, metavar="N")
    p.add_argument("--bench-output-tokens", type=int, default=spec.output_tokens, metavar="N")
    p.set_defaults(func=cmd_models_eval)


@dataclass
class Options:
    gateway: str
    api_key: str
    pool: str = ""
    concurrency: int = 4
    start_timeout_s: float = 900.0
    bench: BenchSpec | None = field(default_factory=BenchSpec)
    answers: str = ""
    canary: bool = True  # record the golden record on the candidate's replica if it passes


@dataclass
class VersionRun:
    run: SuiteRun
    served_by: str
    engine_version: str
    engine_args: list[str]
    benchmark: Benchmark | None = None


def cmd_models_eval(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(f"[eval] {line}", file=sys.stderr, flush=True)

    try:
        config = load_config(config_path(args.config))
        suite = load_suite(args.suite)
        options = Options(
            gateway=(args.gateway or _gateway_url(config)).rstrip("/"),
            api_key=_api_key(args.api_key_file),
            pool=args.pool or "",
            concurrency=args.concurrency,
            start_timeout_s=args.start_timeout,
            bench=None
            if args.no_bench
            else BenchSpec(
                workload=args.bench_workload,
                requests=args.bench_requests,
                rate=args.bench_rate,
                prompt_tokens=args.bench_prompt_tokens,
                output_tokens=args.bench_output_tokens,
            ),
            answers=args.answers or "",
            canary=not args.no_canary,
        )
        if options.pool:
            config.pool(options.pool)  # a typo fails now, not after the baseline's run
        evaluation = evaluate(config, args.ref, suite, args.baseline, options, say)
    except SuiteError as err:
        print(f"hpcserve models eval: the suite does not load:\n{err}", file=sys.stderr)
        return 2
    except (RegistryError, EvalError, ScorerError, ValueError) as err:
        print(f"hpcserve models eval: {err}", file=sys.stderr)
        return 2
    print(format_evaluation(evaluation))
    return 0 if evaluation.passed else 1


class EvalError(RuntimeError):
    """The evaluation could not be run (no replica, no key, the gateway refused)."""


def evaluate(
    config: PlatformConfig,
    ref: str,
    suite: Suite,
    baseline_ref: str | None,
    options: Options,
    say: Say,
) -> Evaluation:
    """Evaluate `ref` (and `baseline_ref` the same way, first), gate it, record it."""
    with Registry(Path(config.registry_path())) as registry:
        candidate = registry.version(ref).ref
        baseline = registry.version(baseline_ref).ref if baseline_ref else ""
        rule = registry.gate_rule(candidate.partition("@")[0])
    if baseline == candidate:
        raise EvalError(f"the baseline is {candidate} itself; give another version")
    base_run = None
    if baseline:
        say(f"baseline {baseline}: running suite {suite.name} ({len(suite.cases)} cases)")
        base_run = _run_version(config, baseline, suite, options, say, bench=False)
    say(f"candidate {candidate}: running suite {suite.name} ({len(suite.cases)} cases)")
    verdict: list[tuple[bool, list[MetricResult], list[str], str]] = []

    def gate(run: VersionRun, target: Target) -> None:
        """Judge the candidate while its replica still serves; record its canaries if passed."""
        passed, results, reasons = judge(
            run.run.scores,
            suite.key_metrics,
            baseline=base_run.run.scores if base_run else None,
            max_drop=rule.max_drop,
            floors=suite.min_scores,
        )
        if not passed:
            canary = "not recorded: the version did not pass its gate"
        elif not options.canary:
            canary = f"not recorded (--no-canary): hpcserve models canary record {candidate}"
        else:
            canary = record_golden_canary(config, candidate, target, say)
        verdict.append((passed, results, reasons, canary))

    cand = _run_version(config, candidate, suite, options, say, bench=True, then=gate)
    if options.answers:
        cand.run.write_answers(Path(options.answers))
    passed, results, reasons, canary = verdict[0]
    evaluation = Evaluation(
        ref=candidate,
        suite=suite.name,
        suite_digest=suite.digest,
        suite_path=str(Path(suite.path).resolve()),
        cases=len(suite.cases),
        scores=cand.run.scores,
        key_metrics=list(suite.key_metrics),
        passed=passed,
        results=results,
        reasons=reasons,
        baseline=baseline,
        baseline_scores=base_run.run.scores if base_run else {},
        baseline_engine_version=base_run.engine_version if base_run else "",
        max_drop=rule.max_drop,
        errors=cand.run.errors,
        engine_version=cand.engine_version,
        engine_args=cand.engine_args,
        served_by=cand.served_by,
        benchmark=cand.benchmark,
        actor=_actor(),
        canary=canary,
    )
    with Registry(Path(config.registry_path())) as registry:
        recorded = registry.record_evaluation(evaluation)
    log.info(
        "evaluation %d of %s: %s (suite %s, baseline %s)",
        recorded.id, candidate, recorded.verdict, suite.name, baseline or "none",
    )  # fmt: skip
    return recorded


def _run_version(
    config: PlatformConfig,
    ref: str,
    suite: Suite,
    options: Options,
    say: Say,
    *,
    bench: bool,
    then: Callable[[VersionRun, Target], None] | None = None,
) -> VersionRun:
    """Run `suite` (and the benchmark if `bench`) on a replica of `ref`, then `then` while
    that replica still serves (a canary job is drained after it)."""
    from hpcserve.contracts.router_client import RouterQueryError
    from hpcserve.onboarding import replica
    from hpcserve.slurm.client import SlurmError

    try:
        target = replica.find_serving(config, ref)
    except RouterQueryError as err:
        raise EvalError(f"cannot ask the router which replicas serve {ref}: {err}") from None
    slurm, job_id, pool = None, 0, None
    if target is None:
        if not options.pool:
            raise EvalError(
                f"no replica serves {ref}; give --pool POOL to start one as a Slurm job of "
                "that pool's shape (a canary pool)"
            )
        pool = replica.canary_pool(config, options.pool, ref)
        try:
            slurm, job_id = replica.start_canary(config, pool, say)
        except SlurmError as err:
            raise EvalError(f"cannot submit the canary job for {ref}: {err}") from None
    try:
        if slurm is not None and pool is not None:
            target = replica.wait_serving(
                config, slurm, job_id, pool, say, timeout_s=options.start_timeout_s
            )
        assert target is not None
        say(f"{ref} is served by {target.describe()}")
        client = _client(options)
        run = run_suite(suite, client, target.model, concurrency=options.concurrency, say=say)
        say(f"{ref}: " + ", ".join(f"{m} {v:g}" for m, v in run.scores.items()))
        result = VersionRun(
            run=run,
            served_by=target.describe(),
            engine_version=replica.engine_version(config, target),
            engine_args=target.engine_args,
        )
        if bench and options.bench is not None:
            say(f"benchmark of {ref}: {options.bench.describe()}")
            result.benchmark = benchmark(
                options.bench,
                options.gateway,
                options.api_key,
                target.model,
                tokenizer=_tokenizer_of(config, ref),
            )
        if then is not None:
            then(result, target)
        return result
    except replica.ReplicaError as err:
        raise EvalError(str(err)) from None
    finally:
        if slurm is not None:
            replica.stop_canary(config, slurm, job_id, say)


def record_golden_canary(config: PlatformConfig, ref: str, target: Target, say: Say) -> str:
    """Record `ref`'s golden record on the target's first replica (the one that ran the eval)
    and write its file for the version's replicas (poolmgr/canary_records.py); what happened,
    in words (kept in the evaluation). Never raises: the gate's verdict stands either way."""
    from hpcserve.contracts.canary_client import CanaryRunError
    from hpcserve.contracts.engine_token import EngineTokenError, read_token
    from hpcserve.modelcache.canary import record_canary
    from hpcserve.poolmgr.canary_records import write_record_file

    replicas = sorted(target.replicas, key=lambda r: r.replica_id)
    if not replicas:
        return f"not recorded: no replica listed; hpcserve models canary record {ref}"
    replica = replicas[0]
    try:
        token = read_token(config.engine_token_path())
    except EngineTokenError:
        token = ""
    by_hand = f"hpcserve models canary record {ref} --config"
    with Registry(Path(config.registry_path())) as registry:
        kept = registry.canary_record(ref)
        if kept is not None:
            note = (
                f"kept the golden record recorded on {kept.recorded_from} "
                f"(hpcserve models canary clear {ref}, then {by_hand}, to record anew)"
            )
            say(f"canary: {note}")
            return note
        say(f"canary: decoding the golden record of {ref} on {replica.url}")
        try:
            record = record_canary(
                registry, ref, replica.url, model=target.model, engine_token=token
            )
        except (CanaryRunError, RegistryError) as err:
            note = f"not recorded on {replica.url}: {err} (record by hand: {by_hand})"
            log.warning("golden record of %s %s", ref, note)
            say(f"canary: {note}")
            return note
        try:
            write_record_file(registry, config.state_dir, ref)
        except OSError as err:  # the pool manager writes it within 30 s anyway
            log.warning("cannot write the golden record file of %s: %s", ref, err)
    tokens = sum(len(a.tokens) for a in record.answers)
    note = (
        f"golden record recorded on {replica.url} ({len(record.answers)} prompts, {tokens} "
        f"tokens, tolerance {record.settings.logprob_tol:g}): every replica of {ref} is checked "
        "against it"
    )
    log.info("golden record of %s recorded on %s after its gate passed", ref, replica.url)
    say(f"canary: {note}")
    return note


def _client(options: Options) -> Any:
    try:
        import openai
    except ImportError:
        raise EvalError("`hpcserve models eval` needs the openai package") from None
    return openai.OpenAI(
        base_url=options.gateway + "/v1", api_key=options.api_key, max_retries=2, timeout=300
    )


def _tokenizer_of(config: PlatformConfig, ref: str) -> str:
    with Registry(Path(config.registry_path())) as registry:
        return str(Path(registry.version(ref).source) / "tokenizer.json")


def _gateway_url(config: PlatformConfig) -> str:
    host = config.gateway.host if config.gateway.host not in ("", "0.0.0.0") else "127.0.0.1"
    scheme = "https" if config.gateway.tls_cert else "http"
    return f"{scheme}://{host}:{config.gateway.port}"


def _api_key(path: str) -> str:
    """The gateway API key from a file (never from argv)."""
    if path:
        try:
            key = Path(path).read_text().strip()
        except OSError as err:
            raise EvalError(f"cannot read the API key file {path}: {err.strerror}") from None
        if not key:
            raise EvalError(f"the API key file {path} is empty")
        return key
    key = os.environ.get("HPCSERVE_API_KEY", "")
    if not key:
        raise EvalError(
            "no API key for the gateway: give --api-key-file FILE (or set "
            "$HPCSERVE_API_KEY_FILE or $HPCSERVE_API_KEY)"
        )
    return key


def _actor() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def format_evaluation(e: Evaluation) -> str:
    """A person's view: the gate's table, the benchmark, the engine, the verdict."""
    against = f" vs {e.baseline}" if e.baseline else " (no baseline: the suite's floors only)"
    lines = [
        f"{e.ref}{against} on suite {e.suite} ({e.cases} cases, {e.errors} failed requests); "
        f"gate: no key metric more than {e.max_drop:g} points below the baseline",
    ]
    header = ["METRIC", "SCORE", "BASELINE", "DELTA", "KEY", "RESULT"]
    rows = []
    key = {r.metric: r for r in e.results}
    for metric, value in e.scores.items():
        r = key.get(metric)
        base = e.baseline_scores.get(metric)
        rows.append(
            [
                metric,
                f"{value:.2f}",
                "" if base is None else f"{base:.2f}",
                "" if base is None else f"{value - base:+.2f}",
                "yes" if r else "",
                ("ok" if r.passed else "FAIL") if r else "",
            ]
        )
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines += [f"  {reason}" for reason in e.reasons]
    if e.benchmark is not None:
        b = e.benchmark
        lines.append(
            f"benchmark ({b.workload}): {b.ok}/{b.requests} ok, TTFT p50 {b.ttft_p50_s:g} s "
            f"p90 {b.ttft_p90_s:g} s, TPOT p50 {b.tpot_p50_s:g} s p90 {b.tpot_p90_s:g} s, "
            f"{b.output_tokens_per_s:g} output tokens/s, {b.requests_per_s:g} requests/s"
        )
    lines.append(f"engine: {e.engine_version}, args: {' '.join(e.engine_args) or '(none)'}")
    lines.append(f"served by: {e.served_by}")
    if e.canary:
        lines.append(f"canary: {e.canary}")
    lines.append(f"verdict: {e.verdict.upper()} (evaluation {e.id} recorded for {e.ref})")
    return "\n".join(lines)
