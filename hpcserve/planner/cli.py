"""``hpcserve plan``: how many GPUs for this model, traffic and SLO, and what a token costs.

    hpcserve plan --model llama-3.1-70b|PATH/config.json --gpu h100
        [--weights-dtype bf16|fp16|fp8|int4] [--kv-dtype bf16|fp16|fp8] [--context 8192] [--tp N]
        [--concurrent-streams N --tokens-per-s-each X
         | --requests-per-s R --prompt-tokens P --output-tokens O]
        [--ttft-slo-ms MS] [--tpot-slo-ms MS] [--spares 1] [--gpus-per-node 8] [--gpus N]
        [--gpu-hour-usd 2.5] [--utilisation 0.6] [--api-usd-per-m-input X --api-usd-per-m-output Y]
        [--batch-docs N --batch-input-tokens I --batch-output-tokens O [--batch-window-h H]]
        [--batch B] [--calibrate FILE] [--json]
        [--pd [--pd-mix P:O:S,...] [--pd-link nvlink|ib|roce|ethernet] [--pd-link-gb-s X]
         [--pd-link-latency-us US] [--pd-per-token]]

Prints a table (or the report as JSON with ``--json``); bad input prints
``hpcserve plan: error: ...`` naming the flag and exits 2. docs/planner.md has the formulas.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from hpcserve.planner.dtypes import KV_DTYPES, WEIGHTS_DTYPES
from hpcserve.planner.errors import PlanError
from hpcserve.planner.gpus import GPUS
from hpcserve.planner.models import MODELS
from hpcserve.planner.pd import LINKS
from hpcserve.planner.plan import plan
from hpcserve.planner.request import PlanRequest
from hpcserve.planner.table import format_report

DESCRIPTION = """\
Size GPUs for a model, a traffic and a latency SLO, and price a token: KV cache and
concurrency per replica, the smallest tensor-parallel size that fits, roofline throughput
(or measured throughput with --calibrate), replicas and nodes for a workload, GPU-hours of a
batch job, cost per million tokens and break-even against an API. Every figure is an
estimate; docs/planner.md has the formulas and assumptions.

examples:
  hpcserve plan --model llama-3.1-8b --gpu h100 --requests-per-s 12 --prompt-tokens 1500 \\
      --output-tokens 350 --ttft-slo-ms 1000 --tpot-slo-ms 40
  hpcserve plan --model llama-3.1-70b --gpu h100 --context 4096 --batch-docs 1000000 \\
      --batch-input-tokens 3000 --batch-output-tokens 500 --batch-window-h 24 --gpus 32
  hpcserve plan --model /models/my-model/config.json --gpu mi300x --concurrent-streams 100 \\
      --tokens-per-s-each 20 --json
"""


def cmd_plan(args: argparse.Namespace) -> int:
    fields = {name: getattr(args, name) for name in PlanRequest.__struct_fields__}
    try:
        report = plan(PlanRequest(**fields))
    except PlanError as err:
        print(f"hpcserve plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
    else:
        print(format_report(report))
    return 0


def add_plan_parser(subparsers: Any) -> None:
    """Register ``plan`` on an ``add_subparsers()`` object; its ``func`` returns an exit code."""
    p = subparsers.add_parser(
        "plan",
        help="size GPUs for a model, a traffic and an SLO; cost per token (estimates)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _replica_flags(p.add_argument_group("model and replica"))
    _workload_flags(p.add_argument_group("workload and SLO (give one workload, or none)"))
    _cost_flags(p.add_argument_group("fleet, batch job and money"))
    _pd_flags(p.add_argument_group("disaggregated prefill/decode (--pd)"))
    p.add_argument("--calibrate", metavar="FILE", help="measured throughput (docs/planner.md)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_plan)


def _replica_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--model", required=True, help=f"{', '.join(MODELS)}, or a config.json / model dir"
    )
    g.add_argument("--gpu", required=True, help=", ".join(sorted(GPUS)))
    g.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default="bf16")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    g.add_argument(
        "--context", type=int, default=8192, metavar="N", help="max tokens per sequence (8192)"
    )
    g.add_argument("--tp", type=int, metavar="N", help="tensor parallel (default: smallest fit)")
    g.add_argument("--gpus-per-node", type=int, metavar="N", help="default: the catalog's (8)")
    g.add_argument("--batch", type=int, metavar="B", help="report TTFT/TPOT at this batch")


def _workload_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--concurrent-streams", type=int, metavar="N")
    g.add_argument("--tokens-per-s-each", type=float, metavar="X", help="per stream")
    g.add_argument("--requests-per-s", type=float, metavar="R")
    g.add_argument("--prompt-tokens", type=int, metavar="P", help="with streams: for TTFT only")
    g.add_argument("--output-tokens", type=int, metavar="O")
    g.add_argument("--ttft-slo-ms", type=float, metavar="MS")
    g.add_argument("--tpot-slo-ms", type=float, metavar="MS")


def _cost_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--spares", type=int, default=1, metavar="N", help="spare replicas (1: N+1)")
    g.add_argument("--gpus", type=int, metavar="N", help="a GPU budget to evaluate")
    g.add_argument("--gpu-hour-usd", type=float, metavar="USD", help="placeholder: 2.5")
    g.add_argument(
        "--utilisation", type=float, default=0.6, metavar="U", help="average share used (0.6)"
    )
    g.add_argument("--api-usd-per-m-input", type=float, metavar="USD")
    g.add_argument("--api-usd-per-m-output", type=float, metavar="USD")
    g.add_argument("--batch-docs", type=int, metavar="N")
    g.add_argument("--batch-input-tokens", type=int, metavar="I", help="per document")
    g.add_argument("--batch-output-tokens", type=int, metavar="O", help="per document")
    g.add_argument("--batch-window-h", type=float, metavar="H")


def _pd_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--pd",
        action="store_true",
        help="compare PD pools with colocated replicas on the same GPUs (--gpus, else the "
        "fleet's); propose the prefill:decode ratio",
    )
    g.add_argument(
        "--pd-mix",
        metavar="P:O:S,...",
        help="request classes: prompt:output:share (default: the requests workload)",
    )
    g.add_argument("--pd-link", default="ib", help=f"{', '.join(LINKS)} (ib)")
    g.add_argument("--pd-link-gb-s", type=float, metavar="GB/S", help="override its bandwidth")
    g.add_argument("--pd-link-latency-us", type=float, metavar="US", help="per transfer")
    g.add_argument(
        "--pd-per-token",
        action="store_true",
        help="hold every token gap (ITL p95) to --tpot-slo-ms, not each request's mean",
    )
