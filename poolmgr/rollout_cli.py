"""`hpcserve rollout start|status|pause|resume|abort`: staged rollouts of a new version
behind an alias (poolmgr/rollout.py), carried out by the pool manager's rollout loop.

`start` checks what it can at once (the alias, the version, the steps, the version's parity
gate) and records the rollout; the loop applies the first step at its next check. `abort`
drops the canary at once itself, so it works with the pool manager down. Exit codes: 0
done, 2 refused (one line on stderr naming why).
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from hpcserve.config import PlatformConfig, config_path, load_config, rollout_steps_problem
from hpcserve.modelcache.registry import Registry, RegistryError
from hpcserve.poolmgr import rollout as ro
from hpcserve.poolmgr.rollout_controller import apply
from hpcserve.poolmgr.rollout_state import RolloutBook, RolloutStateError

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


class Refused(Exception):
    pass


def parse_duration(text: str) -> float:
    """'10m', '90s', '1h' or plain seconds."""
    match = _DURATION.match(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise Refused(f"--every: {text!r} is not a duration like 10m, 90s, 1h")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def parse_steps(text: str) -> list[int]:
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        raise Refused(f"--steps: {text!r} is not a comma-separated list of percents") from None
    if problem := rollout_steps_problem(steps):
        raise Refused(f"--steps: {problem}, got {text!r}")
    return steps


def add_rollout_parser(
    sub: Any, with_config: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    rollout = sub.add_parser("rollout", help="staged rollout of a new version behind an alias")
    rsub = rollout.add_subparsers(dest="rollout_command", required=True, metavar="COMMAND")
    p = with_config(rsub.add_parser("start", help="move ALIAS to REF in steps of canary share"))
    p.add_argument("alias")
    p.add_argument("ref", help="the new version, NAME@VERSION")
    p.add_argument("--steps", help="canary shares in percent, rising, ending at 100 "
                   "(default: rollout.steps, 1,5,25,50,100)")  # fmt: skip
    p.add_argument("--every", help="how long each step holds, e.g. 10m (default: rollout.every_s)")
    p.add_argument("--force", action="store_true", help="start although REF has not passed "
                   "its parity gate (needs --reason)")  # fmt: skip
    p.add_argument("--reason", default="", help="why, with --force (kept in the registry's audit)")
    p.set_defaults(func=_guard(cmd_start))
    p = with_config(rsub.add_parser("status", help="where the rollouts stand"))
    p.add_argument("alias", nargs="?")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guard(cmd_status))
    for name, text in (
        ("pause", "hold the current step (still watched: a breach still rolls back)"),
        ("resume", "go on; the current step's hold starts over"),
        ("abort", "stop now and drop the new version's share to 0"),
    ):
        p = with_config(rsub.add_parser(name, help=text))
        p.add_argument("alias")
        if name == "abort":
            p.add_argument("--reason", default="", help="kept with the rollout's state")
        p.set_defaults(func=_guard(cmd_change))


def _guard(func: Callable[[argparse.Namespace, PlatformConfig], int]) -> Callable[..., int]:
    def run(args: argparse.Namespace) -> int:
        config = load_config(config_path(args.config))
        try:
            return func(args, config)
        except (Refused, RegistryError, RolloutStateError) as err:
            print(f"hpcserve rollout {args.rollout_command}: {err}", file=sys.stderr)
            return 2

    return run


def cmd_start(args: argparse.Namespace, config: PlatformConfig) -> int:
    steps = parse_steps(args.steps) if args.steps else list(config.rollout.steps)
    every_s = parse_duration(args.every) if args.every else config.rollout.every_s
    if args.force and not args.reason.strip():
        raise Refused("--force needs --reason TEXT (it is kept in the registry's audit)")
    with Registry(Path(config.registry_path())) as reg:
        alias = reg.alias(args.alias)
        ref = reg.version(args.ref).ref
        if ref == alias.target:
            raise Refused(f"{ref} is already the target of alias {alias.name!r}")
        if alias.canary is not None:
            raise Refused(
                f"alias {alias.name!r} has canary {alias.canary} at {alias.canary_percent}%; "
                f"drop it first (hpcserve models promote {alias.name} {alias.canary} --share 0)"
            )
        passed, why = reg.gate_status(ref)
        if not passed and not args.force:
            raise Refused(f"{why}; to roll it out anyway give --force --reason TEXT")
        forced = "" if passed else f"{args.reason.strip()} (by {_actor()})"
        now = time.time()
        rollout = ro.Rollout(
            alias=alias.name, ref=ref, stable=alias.target, steps=steps, every_s=every_s,
            forced=forced, started=now, updated=now,
            reason="started" + (f", gate overridden: {forced}" if forced else f" ({why})"),
        )  # fmt: skip
        with RolloutBook(Path(config.state_dir)).change() as rollouts:
            current = rollouts.get(alias.name)
            if current is not None and current.active:
                raise Refused(f"{ro.describe(current)}; abort it first")
            rollouts[alias.name] = rollout
    print(
        f"rollout {alias.name}: {ref} over {alias.target} in steps of "
        f"{','.join(map(str, steps))}% every {every_s:g}s; the pool manager applies the first "
        f"step at its next check (every {config.rollout.check_s:g}s)"
    )
    return 0


def cmd_status(args: argparse.Namespace, config: PlatformConfig) -> int:
    rollouts = RolloutBook(Path(config.state_dir)).read()
    shown = [r for alias, r in sorted(rollouts.items()) if args.alias in (None, alias)]
    if args.alias and not shown:
        raise Refused(f"no rollout of alias {args.alias!r}")
    if args.json:
        print(json.dumps([msgspec.to_builtins(r) | {"share": r.share} for r in shown], indent=2))
        return 0
    if not shown:
        print("no rollouts")
    for r in shown:
        print(ro.describe(r))
        if r.note:
            print(f"  now: {r.note}")
        print(f"  steps {','.join(map(str, r.steps))}% every {r.every_s:g}s; updated "
              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r.updated))}")  # fmt: skip
    return 0


def cmd_change(args: argparse.Namespace, config: PlatformConfig) -> int:
    command, now = args.rollout_command, time.time()
    with RolloutBook(Path(config.state_dir)).change() as rollouts:
        r = rollouts.get(args.alias)
        if r is None or not r.active:
            what = ro.describe(r) if r is not None else f"no rollout of alias {args.alias!r}"
            raise Refused(f"{what}: nothing to {command}")
        if command == "pause":
            if r.state == ro.PAUSED:
                raise Refused(f"{ro.describe(r)}: paused already")
            changed = ro.pause(r, now)
        elif command == "resume":
            if r.state != ro.PAUSED:
                raise Refused(f"{ro.describe(r)}: not paused")
            changed = ro.resume(r, now)
        else:
            why = f"aborted by {_actor()}" + (f": {args.reason}" if args.reason else "")
            changed = ro.abort(r, now, why)
            with Registry(Path(config.registry_path())) as reg:
                apply(reg, changed, 0)
        rollouts[args.alias] = changed
    print(ro.describe(changed))
    return 0


def _actor() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown user"
