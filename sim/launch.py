"""`hpcserve engine --engine sim` runs this instead of vLLM: one simulated engine process.

The engine itself is hpcserve.sim (vLLM's OpenAI API, /metrics and KV-event stream with
timing from the capacity planner's roofline); this module is its process entry, started
by the same supervision, registration and drain code as vLLM, so control-plane tests run
real Slurm jobs that are ready in a second. It is never a substitute for vLLM where the
engine itself is under test. SIGTERM drains like vLLM with --shutdown-timeout: new
connections are refused, running requests finish, then the process exits 0.

`--sim-load-s LO[,HI]` (with `--sim-load-seed N`) makes it serve only a drawn staging +
load time after its job started, as a real engine would (sim/startup.py): for rehearsals
and benchmarks of cold starts.

`--headless` stands in for a headless vLLM on node rank > 0 of a multi-node replica: it
serves nothing and exits 0 on SIGTERM or SIGINT, so multi-node wiring (srun, ranks, drain)
can be tested without vLLM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

import uvicorn

from hpcserve.contracts.engine_token import TOKEN_ENV, EngineTokenGuard
from hpcserve.sim.options import OptionsError, add_arguments, sim_config
from hpcserve.sim.startup import LoadSpecError, parse_load_s, wait_loaded


def wait_headless() -> None:
    """A headless rank: nothing to serve; exit 0 when told to stop."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headless", action="store_true", help="a worker-only rank: wait")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument(
        "--sim-load-s", default="", help="staging + load: serve LO[,HI] s after the job started"
    )
    parser.add_argument("--sim-load-seed", type=int, default=None, help="seeds --sim-load-s")
    add_arguments(parser)
    args, _unknown_vllm_args = parser.parse_known_args(argv)
    if args.headless:
        wait_headless()
        return
    if not args.port:
        parser.error("--port is required unless --headless")
    try:
        config = sim_config(args)
        if args.sim_load_s:
            parse_load_s(args.sim_load_s)
    except (OptionsError, LoadSpecError) as err:
        print(f"sim engine: {err}", file=sys.stderr)
        sys.exit(2)
    from hpcserve.sim.engine import SimEngine
    from hpcserve.sim.server import build_app
    from hpcserve.sim.tokenizer import load_tokenizer

    engine = SimEngine(config, load_tokenizer(args.model or None))
    if args.sim_load_s:
        drawn = wait_loaded(args.sim_load_s, args.sim_load_seed)
        print(f"sim engine: staging + load {drawn:.2f} s after the job started", flush=True)
    print(
        f"sim engine {config.served_model_name}: {config.hardware.description}, "
        f"{config.hardware.kv_blocks} KV blocks of {config.hardware.block_size}, "
        f"tokenizer {engine.tokenizer.name}, time scale {config.time_scale:g}",
        flush=True,
    )
    # uvicorn re-raises the SIGTERM it handled once it has drained; like vLLM, exit 0 instead.
    signal.signal(signal.SIGTERM, lambda *_: None)
    app: Any = build_app(engine)
    if os.environ.get(TOKEN_ENV):  # as vLLM: the engine token guards it (hpcserve engine)
        app = EngineTokenGuard(app)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(args.shutdown_timeout),
    )


if __name__ == "__main__":
    main()
