"""One reconcile pass of the pool manager over 10, 100 and 1,000 real Slurm jobs.

The jobs are real, held (`sbatch --hold`) hpcserve jobs in a local two-node Slurm cluster,
so `squeue --json` returns them all; the pool's desired size equals the job count, so a
pass observes and decides but submits nothing. Measured per pass: the pool manager's own
CPU time (time.process_time: parsing, reconcile, status file; the squeue and sinfo child
processes are not ours), wall time, and the number of squeue calls.

    .venv/bin/python bench/poolmgr_reconcile.py [--sizes 10,100,1000] [--passes 5]

Needs root and Debian's Slurm packages (as `make test` does). Prints a markdown table and
writes bench/results/poolmgr_reconcile.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.config import parse_config  # noqa: E402
from hpcserve.localslurm import LocalSlurm, LocalSlurmSpec  # noqa: E402
from hpcserve.poolmgr.manager import PoolManager  # noqa: E402
from hpcserve.poolmgr.spec import pool_spec_digest  # noqa: E402
from hpcserve.slurm.client import SlurmCLI  # noqa: E402
from tests.integration.slurm_helpers import free_port_block  # noqa: E402

SCRIPT = "#!/bin/bash\n#SBATCH --gres=gpu:1\n#SBATCH -o /dev/null\nsleep 1\n"


def submit_held(slurm: SlurmCLI, count: int, start: int, spec: str) -> None:
    for i in range(start, start + count):
        comment = f"hpcserve:pool=p;model=m;spec={spec};nonce={i:08x}"
        slurm.submit(SCRIPT, extra_args=["--hold", "-J", "bench-p", f"--comment={comment}"])
        if (i + 1) % 200 == 0:
            print(f"  submitted {i + 1} held jobs", file=sys.stderr, flush=True)


def measure(manager: PoolManager, slurm: SlurmCLI, passes: int) -> dict[str, float]:
    cpu, wall = [], []
    squeue_before = slurm.calls["squeue"]
    for _ in range(passes):
        c0, w0 = time.process_time(), time.perf_counter()
        plan = manager.poll_once()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        assert plan is not None and plan.actions == [], plan
    return {
        "cpu_ms": statistics.median(cpu) * 1000,
        "wall_ms": statistics.median(wall) * 1000,
        "squeue_per_pass": (slurm.calls["squeue"] - squeue_before) / passes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="hpcserve-bench-slurm-"))
    cluster = LocalSlurm(LocalSlurmSpec(state_dir=work / "slurm", ctld_port=free_port_block()))
    cluster.start()
    rows = []
    release = "unknown"
    try:
        slurm = SlurmCLI(cluster.env(), timeout_s=60)
        release = slurm.release()
        submitted = 0
        for size in sizes:
            config = parse_config({
                "state_dir": str(work / "state"),
                "slurm": {"conf": str(cluster.conf_path)},
                "poolmgr": {"job_name_prefix": "bench"},
                "pools": [{"name": "p", "model_path": "/m", "served_model_name": "m",
                           "replicas": size}],
            })  # fmt: skip
            # The jobs carry the pool's current spec, so none of them is replaced.
            submit_held(
                slurm, size - submitted, submitted, pool_spec_digest(config, config.pools[0])
            )
            submitted = size
            manager = PoolManager(config, slurm, router_endpoint=None)
            warm = manager.poll_once()  # imports, first status file
            assert warm is not None and warm.actions == [], warm
            row = {"jobs": size, **measure(manager, slurm, args.passes)}
            rows.append(row)
            print(
                f"{size:5d} jobs: {row['cpu_ms']:.1f} ms CPU, {row['wall_ms']:.1f} ms wall, "
                f"{row['squeue_per_pass']:.0f} squeue per pass",
                file=sys.stderr,
                flush=True,
            )
    finally:
        cluster.stop()
    print(
        "\n| hpcserve jobs in Slurm | pool manager CPU per pass | wall per pass | squeue calls "
        "per pass |\n|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['jobs']} | {row['cpu_ms']:.1f} ms | {row['wall_ms']:.1f} ms | "
            f"{row['squeue_per_pass']:.0f} |"
        )
    write_results("poolmgr_reconcile", {"rows": rows}, {"slurm": release, "passes": args.passes})


if __name__ == "__main__":
    main()
