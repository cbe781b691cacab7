"""Golden records in the registry: `hpcserve models canary record|check|show|clear|prompts`,
and `record_canary`, which the onboarding gate calls when a version passes.

A record is decoded on a replica that serves the version now: `--url` names it (with the
engine token of `--engine-token-file`), or `--config` lets the router name one whose
`model_ref` is the version (and the config gives the token's file). The prompts are the
model's own (`models canary prompts MODEL FILE`), else the shipped ones
(contracts/canary.py); `--prompts FILE` overrides both for one record. Exit codes as in
modelcache/cli.py; `check` exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from hpcserve.contracts.canary import (
    DEFAULT_LOGPROB_TOL,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPTS,
    DEFAULT_TOP_LOGPROBS,
    CanaryError,
    CanarySettings,
    GoldenRecord,
    check_settings,
)
from hpcserve.contracts.canary_client import (
    CanaryRunError,
    check_replica,
    record_golden,
    served_model,
)
from hpcserve.contracts.engine_token import FILE_ENV, EngineTokenError, read_token
from hpcserve.contracts.router_client import RouterQueryError, list_replicas
from hpcserve.modelcache.registry import Registry, RegistryError


def canary_settings(
    registry: Registry,
    ref: str,
    *,
    prompts: tuple[str, ...] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    top_logprobs: int = DEFAULT_TOP_LOGPROBS,
    positions: int = 0,
    logprob_tol: float = DEFAULT_LOGPROB_TOL,
) -> CanarySettings:
    """The settings a record of `ref` uses: `prompts`, else its model's, else the default."""
    model = registry.version(ref).model
    chosen = prompts or registry.canary_prompts(model)
    settings = CanarySettings(
        prompts=tuple(chosen) if chosen else DEFAULT_PROMPTS,
        max_tokens=max_tokens,
        top_logprobs=top_logprobs,
        positions=positions,
        logprob_tol=logprob_tol,
    )
    try:
        return check_settings(settings)
    except CanaryError as err:
        raise RegistryError(f"canary {err}") from None


def record_canary(
    registry: Registry,
    ref: str,
    base_url: str,
    *,
    model: str = "",
    engine_token: str = "",
    settings: CanarySettings | None = None,
    deadline_s: float = 120.0,
) -> GoldenRecord:
    """Decode the canaries on the replica at `base_url` (which serves `ref`, as `model`;
    default: what its /v1/models lists) and store them as `ref`'s golden record. Settings
    default to `canary_settings` (the model's prompts or the shipped ones). Raises
    CanaryRunError when the replica cannot be asked, RegistryError for a bad ref."""
    version = registry.version(ref)
    settings = settings or canary_settings(registry, version.ref)
    model = model or served_model(base_url, engine_token=engine_token)
    record = record_golden(
        base_url,
        model,
        version.ref,
        settings,
        engine_token=engine_token,
        deadline_s=deadline_s,
    )
    return registry.set_canary_record(version.ref, record)


def add_canary_parser(models_subparsers: Any) -> None:
    """`hpcserve models canary record|check|show|clear|prompts`."""
    from hpcserve.modelcache.cli import _guard, _with_registry

    canary = models_subparsers.add_parser(
        "canary", help="numerical canaries: a version's golden record"
    )
    sub = canary.add_subparsers(dest="canary_command", required=True, metavar="COMMAND")

    p = _with_replica(
        _with_registry(sub.add_parser("record", help="record REF's golden record on a replica"))
    )
    p.add_argument("--prompts", metavar="FILE", help="a JSON list of prompts (this record only)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N")
    p.add_argument("--top-logprobs", type=int, default=DEFAULT_TOP_LOGPROBS, metavar="K")
    p.add_argument(
        "--positions",
        type=int,
        default=0,
        metavar="N",
        help="token positions compared per prompt (default 0: all)",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=DEFAULT_LOGPROB_TOL,
        metavar="NATS",
        help=f"logprob tolerance (default {DEFAULT_LOGPROB_TOL:g})",
    )
    p.set_defaults(func=_guard("models canary record", cmd_canary_record))

    p = _with_replica(
        _with_registry(sub.add_parser("check", help="compare a replica with REF's record now"))
    )
    p.set_defaults(func=_guard("models canary check", cmd_canary_check))

    p = _with_registry(sub.add_parser("show", help="REF's golden record"))
    p.add_argument("ref", help="NAME@VERSION (or NAME, or an alias)")
    p.add_argument("--json", action="store_true", help="the whole record")
    p.set_defaults(func=_guard("models canary show", cmd_canary_show))

    p = _with_registry(sub.add_parser("clear", help="drop REF's golden record"))
    p.add_argument("ref", help="NAME@VERSION")
    p.set_defaults(func=_guard("models canary clear", cmd_canary_clear))

    p = _with_registry(sub.add_parser("prompts", help="a model's own canary prompts"))
    p.add_argument("model")
    p.add_argument("file", nargs="?", help="a JSON list of prompts (none: print the prompts)")
    p.add_argument("--default", action="store_true", help="back to the shipped prompts")
    p.set_defaults(func=_guard("models canary prompts", cmd_canary_prompts))


def _with_replica(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("ref", help="NAME@VERSION (or NAME, or an alias)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a replica serving REF: http://host:port")
    where.add_argument(
        "--config",
        nargs="?",
        const="",
        metavar="PATH",
        help="ask the router of this platform config (default $HPCSERVE_CONFIG) for a "
        "replica serving REF; the engine token is the config's",
    )
    p.add_argument(
        "--engine-token-file",
        default=os.environ.get(FILE_ENV, ""),
        help=f"with --url: the engine token's file (default ${FILE_ENV}; empty: none)",
    )
    p.add_argument("--served-model-name", default="", help="default: what /v1/models lists")
    p.add_argument("--deadline-s", type=float, default=120.0, help="for all prompts together")
    return p


def _replica(args: argparse.Namespace, ref: str) -> tuple[str, str, str]:
    """(url, served model name, engine token) of the replica to ask."""
    if args.url is not None:
        token = _token(args.engine_token_file) if args.engine_token_file else ""
        return args.url, args.served_model_name, token
    from hpcserve.config import ConfigError, config_path, load_config

    try:
        cfg = load_config(config_path(args.config or None))
    except ConfigError as err:
        raise RegistryError(f"config: {err}") from None
    try:
        replicas = list_replicas(cfg.router.gateways_dial(), curve_dir=cfg.router.curve_dir)
    except RouterQueryError as err:
        raise RegistryError(f"cannot ask the router for a replica of {ref}: {err}") from None
    serving = sorted((r for r in replicas if r.model_ref == ref), key=lambda r: r.replica_id)
    if not serving:
        raise RegistryError(f"no replica serving {ref} is registered with the router")
    chosen = serving[0]
    return chosen.url, args.served_model_name or chosen.model, _token(cfg.engine_token_path())


def _token(path: str) -> str:
    try:
        return read_token(path)
    except EngineTokenError as err:
        raise RegistryError(str(err)) from None


def _prompts_file(path: str) -> tuple[str, ...]:
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RegistryError(f"cannot read prompts from {path}: {err}") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
        raise RegistryError(f"{path}: expected a JSON list of non-empty strings")
    return tuple(prompts)


def cmd_canary_record(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        ref = reg.version(args.ref).ref
        settings = canary_settings(
            reg,
            ref,
            prompts=_prompts_file(args.prompts) if args.prompts else None,
            max_tokens=args.max_tokens,
            top_logprobs=args.top_logprobs,
            positions=args.positions,
            logprob_tol=args.tol,
        )
        url, model, token = _replica(args, ref)
        try:
            record = record_canary(
                reg,
                ref,
                url,
                model=model,
                engine_token=token,
                settings=settings,
                deadline_s=args.deadline_s,
            )
        except CanaryRunError as err:
            raise RegistryError(f"cannot decode the canaries on {url}: {err}") from None
    tokens = sum(len(a.tokens) for a in record.answers)
    print(
        f"recorded the golden record of {ref} on {url}: {len(record.answers)} prompts, "
        f"{tokens} tokens, tolerance {record.settings.logprob_tol:g}"
    )
    return 0


def cmd_canary_check(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        ref = reg.version(args.ref).ref
        golden = reg.canary_record(ref)
    if golden is None:
        raise RegistryError(f"{ref} has no golden record (hpcserve models canary record)")
    url, model, token = _replica(args, ref)
    try:
        model = model or served_model(url, engine_token=token)
        mismatch = check_replica(url, model, golden, engine_token=token, deadline_s=args.deadline_s)
    except CanaryRunError as err:
        raise RegistryError(f"cannot decode the canaries on {url}: {err}") from None
    if mismatch is not None:
        print(f"{url}: {mismatch.detail()}")
        return 1
    print(f"{url}: matches the golden record of {ref}")
    return 0


def cmd_canary_show(args: argparse.Namespace) -> int:
    from hpcserve.modelcache.cli import _print_json

    with Registry(args.registry) as reg:
        ref = reg.version(args.ref).ref
        record = reg.canary_record(ref)
    if record is None:
        raise RegistryError(f"{ref} has no golden record")
    if args.json:
        _print_json(record)
        return 0
    s = record.settings
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.recorded_at))
    print(f"golden record of {ref}, recorded {when} on {record.recorded_from}")
    print(
        f"greedy, {s.max_tokens} tokens, top {s.top_logprobs} logprobs; compared: "
        f"{s.positions or 'all'} positions, logprob tolerance {s.logprob_tol:g}"
    )
    for i, answer in enumerate(record.answers):
        ids = " ".join(str(t.token_id) for t in answer.tokens)
        print(f"  prompt {i}: {answer.prompt!r} -> {ids}")
    return 0


def cmd_canary_clear(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        ref = reg.version(args.ref).ref
        cleared = reg.clear_canary_record(ref)
    print(f"cleared the golden record of {ref}" if cleared else f"{ref} had no golden record")
    return 0


def cmd_canary_prompts(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        if args.default and args.file:
            raise RegistryError("give a prompts FILE or --default, not both")
        if args.default:
            reg.set_canary_prompts(args.model, None)
        elif args.file:
            reg.set_canary_prompts(args.model, _prompts_file(args.file))
        own = reg.canary_prompts(args.model)
    prompts = own or DEFAULT_PROMPTS
    print(f"{args.model}: {'its own' if own else 'the shipped'} canary prompts")
    for prompt in prompts:
        print(f"  {prompt!r}")
    return 0
