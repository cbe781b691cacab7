"""Run a command and stop it (SIGSTOP) again and again for a while (SIGCONT), as a loaded CI
machine deschedules a process for seconds at any point. Only the command's own process is
stopped unless --group: its subprocesses (engines, gateways) then run on meanwhile, as on a
machine where only the test process waits for a CPU.

    python tests/stall/pauser.py --stop 1.2,2.5 -- .venv/bin/pytest tests/unit/x.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import time


def span(text: str) -> tuple[float, float]:
    low, high = (float(x) for x in text.split(","))
    return low, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap", type=span, default=(0.3, 2.0), help="running between stops, s")
    parser.add_argument("--stop", type=span, default=(0.5, 2.5), help="each stop, s")
    parser.add_argument("--group", action="store_true", help="stop its subprocesses too")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rng = random.Random(args.seed)
    proc = subprocess.Popen(command, start_new_session=True)

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if args.group:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)

    stops, stopped = 0, 0.0
    try:
        while proc.poll() is None:
            time.sleep(rng.uniform(*args.gap))
            if proc.poll() is not None:
                break
            seconds = rng.uniform(*args.stop)
            send(signal.SIGSTOP)
            time.sleep(seconds)
            send(signal.SIGCONT)
            stops, stopped = stops + 1, stopped + seconds
    finally:
        send(signal.SIGCONT)
    code = proc.wait()
    print(f"pauser: {stops} stops, {stopped:.1f} s stopped, exit {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
