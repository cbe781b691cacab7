"""`hpcserve doctor`: what a first install gets wrong, one line per check with its fix."""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys
import tempfile
import time
from pathlib import Path

from hpcserve.config import DEFAULT_STATE_DIR, config_path, load_config


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check an install: Slurm, GRES, node cache, router reachability, keys, clocks, "
        "NVML, vLLM, models (control node, and a GPU node through a Slurm job)",
    )
    p.add_argument(
        "--config",
        help="platform config (TOML); default $HPCSERVE_CONFIG or "
        f"{DEFAULT_STATE_DIR}/hpcserve.toml",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NODE",
        help="run the node checks on this node (repeatable; default: one job wherever Slurm "
        "places it)",
    )
    p.add_argument("--no-node", action="store_true", help="control-node checks only (no job)")
    p.add_argument(
        "--node-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the node job(s), pending time included",
    )
    p.add_argument(
        "--quick", action="store_true", help="check model files by size, not by reading digests"
    )
    p.add_argument(
        "--strict", action="store_true", help="warnings and skipped checks fail the run too"
    )
    p.add_argument(
        "--metrics-file",
        default="",
        help="also write the results here, Prometheus textfile format (node_exporter)",
    )
    p.add_argument(
        "--service-user",
        default=pwd.getpwuid(os.geteuid()).pw_name,
        help="the account the services run as, which must own the keys (default: you)",
    )
    acceptance = p.add_mutually_exclusive_group()
    acceptance.add_argument(
        "--gpu",
        action="store_true",
        help="instead: the GPU acceptance run on this machine (real NVML, a tiny model on "
        "vLLM's GPU build through gateway -> router -> engine, TP=1 and TP=2, KV events, "
        "a drain); docs/gpu-acceptance.md",
    )
    acceptance.add_argument(
        "--cpu", action="store_true", help="the acceptance run on vLLM's CPU build (TP=1)"
    )
    p.add_argument(
        "--work-dir",
        default="",
        help="with --gpu/--cpu: where the run keeps its state and logs (default: a new "
        "directory under /tmp)",
    )
    p.add_argument(
        "--timeout", type=float, default=480.0, help="with --gpu/--cpu: seconds for the whole run"
    )
    # What the doctor's Slurm job runs on the node (doctor/node_job.py).
    p.add_argument("--node-request", default="", help=argparse.SUPPRESS)
    p.add_argument("--node-result", default="", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    started_at = time.time()
    from hpcserve.doctor.run import run_doctor, write_node_facts

    if args.node_request:
        return write_node_facts(
            Path(args.node_request), Path(args.node_result), started_at=started_at
        )
    from hpcserve.doctor.report import exit_status, format_report, report_json, write_metrics

    if args.gpu or args.cpu:
        from hpcserve.doctor.acceptance import run_acceptance

        work = Path(args.work_dir or tempfile.mkdtemp(prefix="hpcserve-acceptance-"))
        print(f"[acceptance] working in {work}", flush=True)
        results = run_acceptance(work, cpu=args.cpu, timeout_s=args.timeout)
        if args.json:
            print(json.dumps(report_json(results), indent=2))
        else:
            print(format_report(results))
        return exit_status(results)
    from hpcserve.poolmgr.spec import hpcserve_executable

    config = load_config(config_path(args.config))
    targets = [] if args.no_node else (args.node or [""])
    results = run_doctor(
        config,
        service_user=args.service_user,
        quick=args.quick,
        node_targets=targets,
        node_timeout_s=args.node_timeout,
        hpcserve_bin=hpcserve_executable(),
        say=lambda line: print(f"[doctor] {line}", file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(report_json(results, strict=args.strict), indent=2))
    else:
        print(format_report(results, strict=args.strict))
    if args.metrics_file:
        write_metrics(args.metrics_file, results)
    return exit_status(results, strict=args.strict)
