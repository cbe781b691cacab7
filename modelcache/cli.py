"""`hpcserve models add|list|show|alias|promote|gate|rm` and `hpcserve cache ...` subcommands.

hpcserve/cli.py wires them in: `add_models_registry_parsers(models_subparsers)` and
`add_cache_parser(subparsers)`. Every subcommand's `func` takes the Namespace and returns
an exit code: 0 done, 1 the check it ran failed (a corrupt entry), 2 a bad request
(unknown name, version in use, bad value), with one line on stderr naming the problem.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from hpcserve.modelcache.cache import CacheEntry, EntryRecord, NodeCache
from hpcserve.modelcache.errors import CacheError
from hpcserve.modelcache.evaluations import Evaluation
from hpcserve.modelcache.locks import LockTimeout, SharedFilesystemError
from hpcserve.modelcache.manifest import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    Manifest,
    ManifestError,
    build_manifest,
    list_files,
)
from hpcserve.modelcache.progress import Progress, human_bytes
from hpcserve.modelcache.refs import RefError, parse_ref
from hpcserve.modelcache.registry import QUANTIZATIONS, Alias, Registry, RegistryError
from hpcserve.modelcache.stage import stage

log = logging.getLogger(__name__)
DEFAULT_REGISTRY = ".state/registry.sqlite3"
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?", re.IGNORECASE)
_EXPECTED = (RegistryError, CacheError, RefError, ManifestError, LockTimeout, SharedFilesystemError)

Handler = Callable[[argparse.Namespace], int]


def add_models_registry_parsers(models_subparsers: Any) -> None:
    """Add add, list, show, alias, promote and rm to the `hpcserve models` group."""
    sub = models_subparsers
    p = _with_registry(sub.add_parser("add", help="register a model version or a LoRA adapter"))
    p.add_argument("name", help="model name (a new version is added) or adapter name")
    p.add_argument("source", help="model directory on the shared filesystem")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="bf16")
    p.add_argument(
        "--engine-args",
        metavar="ARGS",
        default="",
        help='vLLM arguments as one string: --engine-args="--max-model-len 8192 --enforce-eager"',
    )
    p.add_argument("--version", type=int, metavar="N", help="version number (default: next)")
    p.add_argument("--digest", choices=ALGORITHMS, default=DEFAULT_ALGORITHM)
    p.add_argument("--workers", type=int, default=8, metavar="N", help="files hashed at once")
    p.add_argument(
        "--lora-base",
        metavar="MODEL[@N]",
        help="register a LoRA adapter of that base version (default: the latest)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        metavar="R",
        help="adapter rank (default: r in adapter_config.json)",
    )
    p.set_defaults(func=_guard("models add", cmd_models_add))

    p = _with_registry(sub.add_parser("list", help="models, versions, aliases and adapters"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guard("models list", cmd_models_list))

    p = _with_registry(sub.add_parser("show", help="one model, version, alias or adapter"))
    p.add_argument("name", help="NAME or NAME@VERSION")
    p.add_argument("--files", action="store_true", help="with a version: its manifest files")
    p.set_defaults(func=_guard("models show", cmd_models_show))

    p = _with_registry(
        sub.add_parser("alias", help="point an alias at NAME@VERSION (one that passed its gate)")
    )
    p.add_argument("alias")
    p.add_argument("ref", help="NAME@VERSION (or NAME for its latest version)")
    _with_force(p)
    p.set_defaults(func=_guard("models alias", cmd_models_alias))

    p = _with_registry(sub.add_parser("promote", help="route a share of an alias to a version"))
    p.add_argument("alias")
    p.add_argument("ref", help="NAME@VERSION")
    p.add_argument(
        "--share",
        type=int,
        default=100,
        metavar="PCT",
        help="percent of the alias's requests: 100 (default) makes REF the target, "
        "1-99 makes it the canary, 0 drops it as the canary",
    )
    _with_force(p)
    p.set_defaults(func=_guard("models promote", cmd_models_promote))

    p = _with_registry(
        sub.add_parser("gate", help="show or set a model's parity gate (points of allowed drop)")
    )
    p.add_argument("model")
    p.add_argument(
        "--max-drop",
        type=float,
        metavar="POINTS",
        help="a key metric may be at most this many points below the baseline's (default 1)",
    )
    p.set_defaults(func=_guard("models gate", cmd_models_gate))

    p = _with_registry(sub.add_parser("rm", help="remove a version, model, alias or adapter"))
    p.add_argument("name", help="NAME@VERSION, or NAME (a whole model, an alias, an adapter)")
    p.set_defaults(func=_guard("models rm", cmd_models_rm))

    from hpcserve.modelcache.canary import add_canary_parser

    add_canary_parser(sub)  # models canary record|check|show|clear|prompts


def add_cache_parser(subparsers: Any) -> None:
    """Add `hpcserve cache ls|pin|unpin|evict|prefetch|verify` (the node-local cache)."""
    cache = subparsers.add_parser("cache", help="the node-local model cache")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")

    p = _with_cache_dir(csub.add_parser("ls", help="entries, least recently used first"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guard("cache ls", cmd_cache_ls))

    for name, func, text in (
        ("pin", cmd_cache_pin, "never evict an entry"),
        ("unpin", cmd_cache_unpin, "let an entry be evicted again"),
    ):
        p = _with_cache_dir(csub.add_parser(name, help=text))
        p.add_argument("key", help="cache key, or NAME@VERSION naming one entry")
        p.set_defaults(func=_guard(f"cache {name}", func))

    p = _with_cache_dir(csub.add_parser("evict", help="remove entries (not pinned, not in use)"))
    p.add_argument("keys", nargs="*", help="cache keys or NAME@VERSION")
    p.add_argument("--to", metavar="SIZE", help="evict least recently used down to SIZE (200G)")
    p.set_defaults(func=_guard("cache evict", cmd_cache_evict))

    p = _with_registry(_with_cache_dir(csub.add_parser("prefetch", help="stage a model now")))
    p.add_argument("ref", help="NAME@VERSION, NAME (latest) or an alias")
    p.add_argument("--pin", action="store_true", help="pin the entry once staged")
    p.add_argument("--cap", metavar="SIZE", help="evict least recently used entries to fit")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="copy threads")
    p.set_defaults(func=_guard("cache prefetch", cmd_cache_prefetch))

    p = _with_cache_dir(csub.add_parser("verify", help="re-hash entries; corrupt ones re-staged"))
    p.add_argument("keys", nargs="*", help="entries to check (default: all)")
    p.add_argument("--no-restage", action="store_true", help="only remove corrupt entries")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="files hashed at once")
    p.set_defaults(func=_guard("cache verify", cmd_cache_verify))


# -- models


def cmd_models_add(args: argparse.Namespace) -> int:
    source = Path(args.source).resolve()
    if args.lora_base is None and args.lora_rank is not None:
        raise RegistryError("--lora-rank needs --lora-base")
    with Registry(args.registry) as reg:
        reg.check_free(args.name, "model" if args.lora_base is None else "adapter")
        if args.lora_base is not None:
            reg.version(args.lora_base)  # fail before hashing, not after
        manifest = _manifest_of(source, args.digest, args.workers, f"hashing {args.name}")
        if args.lora_base is not None:
            rank = args.lora_rank or _lora_rank(source)
            a = reg.add_adapter(args.name, args.lora_base, str(source), manifest, rank=rank)
            print(f"added adapter {a.name} (base {a.base_ref}, rank {a.rank})")
            return 0
        v = reg.add_version(
            args.name,
            str(source),
            manifest,
            quantization=args.quantization,
            engine_args=shlex.split(args.engine_args),
            version=args.version,
        )
    print(
        f"added {v.ref} ({v.quantization}, {human_bytes(v.total_bytes)} in "
        f"{len(manifest.files)} files, {manifest.algorithm} manifest {v.manifest_digest[:12]})"
    )
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        versions, aliases, adapters = reg.versions(), reg.aliases(), reg.adapters()
        in_use = {v.ref: reg.users(v.ref) for v in versions}
        gates = {v.ref: _gate_cell(reg.latest_evaluation(v.ref)) for v in versions}
    if args.json:
        _print_json(
            {"versions": versions, "aliases": aliases, "adapters": adapters, "gates": gates}
        )
        return 0
    rows = [
        [
            v.ref,
            v.quantization,
            human_bytes(v.total_bytes),
            str(len(in_use[v.ref])),
            gates[v.ref],
            v.source,
        ]
        for v in versions
    ]
    print(_table(["VERSION", "QUANT", "SIZE", "REPLICAS", "GATE", "SOURCE"], rows))
    if aliases:
        print()
        print(_table(["ALIAS", "TARGET", "CANARY"], [_alias_row(a) for a in aliases]))
    if adapters:
        print()
        rows = [[a.name, a.base_ref, str(a.rank), a.path] for a in adapters]
        print(_table(["ADAPTER", "BASE", "RANK", "PATH"], rows))
    return 0


def _gate_cell(last: Evaluation | None) -> str:
    """A version's parity gate in `models list`: its newest evaluation decides (as for
    promotion, Registry.gate_status); "-": never evaluated."""
    if last is None:
        return "-"
    against = f" vs {last.baseline}" if last.baseline else ""
    verdict = "pass" if last.passed else "FAIL"
    return f"{verdict} ({last.suite}{against})"


def cmd_models_show(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        kind = reg.kind(parse_ref(args.name).name)
        if "@" in args.name:
            out: dict[str, Any] = {"version": reg.version(args.name)}
            out["in_use_by"] = reg.users(args.name)
            if args.files:
                out["manifest"] = reg.manifest(args.name)
        elif kind == "alias":
            out = {"alias": reg.alias(args.name)}
        elif kind == "adapter":
            out = {"adapter": reg.adapter(args.name)}
        else:
            out = {"model": reg.model(args.name)}
        out.update(_onboarding_view(reg, args.name, kind))
    _print_json(out)
    return 0


def _onboarding_view(reg: Registry, name: str, kind: str | None) -> dict[str, Any]:
    """What `models show` adds from onboarding: a version's gate and evaluations (the newest
    in full), an alias's audit lines, a model's gate rule."""
    if "@" in name:
        passed, why = reg.gate_status(name)
        evaluations = reg.evaluations(name)
        earlier = [
            {"id": e.id, "at": e.at, "suite": e.suite, "baseline": e.baseline,
             "verdict": e.verdict}
            for e in evaluations[:-1]
        ]  # fmt: skip
        record = reg.canary_record(name)
        canary = None
        if record is not None:  # numerical canaries (modelcache/canary.py)
            canary = {
                "recorded_at": record.recorded_at,
                "recorded_from": record.recorded_from,
                "prompts": len(record.answers),
                "tokens": sum(len(a.tokens) for a in record.answers),
                "logprob_tol": record.settings.logprob_tol,
                "checked": "every replica of this version, before it registers and "
                "every health.canary_interval_s",
            }
        return {
            "gate": {"passed": passed, "why": why},
            "evaluation": evaluations[-1] if evaluations else None,
            "earlier_evaluations": earlier,
            "canary": canary,
        }
    if kind == "alias":
        return {"audit": [e.line() for e in reg.audit_log(name)]}
    if kind == "model":
        return {"gate_rule": reg.gate_rule(name)}
    return {}


def cmd_models_alias(args: argparse.Namespace) -> int:
    reason = _force_reason(args)
    with Registry(args.registry) as reg:
        a = reg.set_alias_gated(args.alias, args.ref, force_reason=reason, actor=_actor())
        _report_forced(reg, a.name, reason)
    print(f"{a.name} -> {a.target}")
    return 0


def cmd_models_promote(args: argparse.Namespace) -> int:
    reason = _force_reason(args)
    with Registry(args.registry) as reg:
        a = reg.promote_gated(args.alias, args.ref, args.share, force_reason=reason, actor=_actor())
        _report_forced(reg, a.name, reason)
    _name, target, canary = _alias_row(a)
    print(f"{a.name} -> {target}" + (f", canary {canary}" if canary else ""))
    return 0


def cmd_models_gate(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        if args.max_drop is not None:
            reg.set_gate_rule(args.model, args.max_drop, actor=_actor())
        else:
            reg.model(args.model)  # an unknown model is named
        rule = reg.gate_rule(args.model)
    default = "" if rule.updated else " (the default)"
    print(
        f"{rule.model}: a version passes when no key metric of its suite is more than "
        f"{rule.max_drop:g} points below its baseline's{default}"
    )
    return 0


def _force_reason(args: argparse.Namespace) -> str:
    if args.force and not (args.reason or "").strip():
        raise RegistryError("--force needs --reason TEXT (it goes into the audit log)")
    if args.reason and not args.force:
        raise RegistryError("--reason goes with --force")
    return args.reason.strip() if args.force else ""


def _report_forced(reg: Registry, alias: str, reason: str) -> None:
    """One audit line on stderr (and the log) when the gate was overridden."""
    last = reg.audit_log(alias)[-1]
    if reason and last.forced:
        log.warning("audit: %s", last.line())
        print(f"audit: {last.line()}", file=sys.stderr)


def _actor() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def cmd_models_rm(args: argparse.Namespace) -> int:
    with Registry(args.registry) as reg:
        print(f"removed {reg.remove(args.name)}")
    return 0


# -- cache


def cmd_cache_ls(args: argparse.Namespace) -> int:
    cache = _open_cache(args)
    entries = cache.entries()
    if args.json:
        _print_json([_entry_view(e) for e in entries])
        return 0
    rows = [
        [
            e.key,
            human_bytes(e.bytes),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_use)),
            "yes" if e.pinned else "",
            str(e.leases) if e.leases else "",
        ]
        for e in entries
    ]
    print(_table(["KEY", "SIZE", "LAST USE", "PINNED", "IN USE"], rows))
    print(f"total {human_bytes(sum(e.bytes for e in entries))} in {len(entries)} entries")
    return 0


def cmd_cache_pin(args: argparse.Namespace) -> int:
    cache = _open_cache(args)
    key = cache.resolve(args.key)
    cache.pin(key)
    print(f"pinned {key}")
    return 0


def cmd_cache_unpin(args: argparse.Namespace) -> int:
    cache = _open_cache(args)
    key = cache.resolve(args.key)
    cache.unpin(key)
    print(f"unpinned {key}")
    return 0


def cmd_cache_evict(args: argparse.Namespace) -> int:
    if bool(args.keys) == bool(args.to):
        raise CacheError("give either entry keys or --to SIZE")
    cache = _open_cache(args)
    if args.to:
        evicted = cache.evict_to(parse_size(args.to))
    else:
        evicted = [cache.resolve(k) for k in args.keys]
        for key in evicted:
            cache.evict(key)
    for key in evicted:
        print(f"evicted {key}")
    return 0


def cmd_cache_prefetch(args: argparse.Namespace) -> int:
    cache = NodeCache(Path(args.cache_dir))
    with Registry(args.registry) as reg:
        version = reg.version(args.ref)
        manifest = reg.manifest(version.ref)
    with Progress(f"staging {version.ref}", manifest.total_bytes) as progress:
        staged = stage(
            manifest,
            Path(version.source),
            cache,
            name=version.model,
            version=version.version,
            progress=progress,
            workers=args.workers,
            cap_bytes=parse_size(args.cap) if args.cap else None,
        )
    if args.pin:
        cache.pin(staged.key)
    print(f"{'staged' if staged.copied else 'already cached'}: {staged.path}")
    return 0


def cmd_cache_verify(args: argparse.Namespace) -> int:
    cache = _open_cache(args)
    keys = [cache.resolve(k) for k in args.keys] or cache.entry_keys()
    bad = 0
    for key in keys:
        record = cache.read_record(key)
        total = record.manifest.total_bytes if record else 0
        with Progress(f"verifying {key}", total) as progress:
            problems = cache.verify(key, workers=args.workers, progress=progress)
        if not problems:
            print(f"ok {key}")
            continue
        bad += 1
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"corrupt {key}: {problems[0]}{more}; removed")
        if record is not None and not args.no_restage:
            _restage(cache, record, args.workers)
    return 1 if bad else 0


# -- helpers


def parse_size(text: str) -> int:
    """`200G`, `1.5TiB`, `500000000` -> bytes (K, M, G, T are powers of 1000; Ki... 1024)."""
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        raise CacheError(f"size {text!r} is not understood; use e.g. 500G, 1.5T or 200GiB")
    number, unit, binary = m.groups()
    power = " KMGT".index(unit.upper() or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)


def _open_cache(args: argparse.Namespace) -> NodeCache:
    """The cache at --cache-dir, which must exist (a typo must not create a new cache)."""
    if not Path(args.cache_dir).is_dir():
        raise CacheError(f"no cache directory at {args.cache_dir}")
    return NodeCache(Path(args.cache_dir))


def _restage(cache: NodeCache, record: EntryRecord, workers: int) -> None:
    source = Path(record.source)
    if not source.is_dir():
        print(f"  cannot re-stage: source {source} is not reachable from this node")
        return
    with Progress(f"re-staging {record.name}@{record.version}", record.manifest.total_bytes) as p:
        staged = stage(
            record.manifest,
            source,
            cache,
            name=record.name,
            version=record.version,
            progress=p,
            workers=workers,
        )
    print(f"  re-staged {staged.key}")


def _manifest_of(source: Path, algorithm: str, workers: int, label: str) -> Manifest:
    total = sum((source / p).stat().st_size for p in list_files(source))
    with Progress(label, total) as progress:
        return build_manifest(source, algorithm=algorithm, workers=workers, progress=progress)


def _lora_rank(source: Path) -> int:
    config = source / "adapter_config.json"
    try:
        rank = json.loads(config.read_text())["r"]
    except (OSError, ValueError, KeyError):
        raise RegistryError(f"give --lora-rank: no readable 'r' in {config}") from None
    if not isinstance(rank, int):
        raise RegistryError(f"{config}: 'r' is {rank!r}, not an integer; give --lora-rank")
    return rank


def _alias_row(a: Alias) -> list[str]:
    canary = f"{a.canary} ({a.canary_percent}%)" if a.canary else ""
    target = f"{a.target} ({100 - a.canary_percent}%)" if a.canary else a.target
    return [a.name, target, canary]


def _entry_view(e: CacheEntry) -> dict[str, Any]:
    record = e.record
    return {
        "key": e.key,
        "bytes": e.bytes,
        "last_use": e.last_use,
        "pinned": e.pinned,
        "leases": e.leases,
        "source": record.source if record else None,
    }


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def _print_json(obj: Any) -> None:
    print(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


def _with_registry(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--registry",
        metavar="PATH",
        default=os.environ.get("HPCSERVE_REGISTRY", DEFAULT_REGISTRY),
        help=f"registry database (default: $HPCSERVE_REGISTRY or {DEFAULT_REGISTRY})",
    )
    return p


def _with_force(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help="move traffic to a version that has not passed its gate (needs --reason)",
    )
    p.add_argument("--reason", metavar="TEXT", help="why the gate is overridden (audit log)")


def _with_cache_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    default = os.environ.get("HPCSERVE_CACHE_DIR")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=default,
        required=default is None,
        help="node-local cache directory (default: $HPCSERVE_CACHE_DIR)",
    )
    return p


def _guard(command: str, func: Handler) -> Handler:
    """Turn the expected errors into one line on stderr and exit code 2."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except _EXPECTED as err:
            print(f"hpcserve {command}: {err}", file=sys.stderr)
            return 2

    return run
