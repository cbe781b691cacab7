"""Staging into the node cache (digest-verified) against `cp -r` of the same files.

Same source files, same disk, one run, the methods alternating round by round; medians
of ROUNDS. Before every copy the source files are dropped from the page cache
(posix_fadvise DONTNEED on those files only), so each method reads from the disk as a
stager reads from a shared filesystem; after every copy the output is flushed (untimed
unless the method syncs) and deleted.

  cp -r           what the goal is measured against (leaves its output in the page cache)
  cp -r + fsync   cp, then fsync of every copied file (timed): the same durability as staging
  stage           hpcserve's stage() as engines run it: parallel chunked copy in the
                  kernel, blake3 of every copied byte, atomic rename (no fsync: hits are
                  verified, see modelcache/stage.py)
  stage + fsync   stage(durable=True): also fsyncs every file and directory
  verify hit      a second stage() of the entry: a re-hash of the cached copy (not a copy)
  hash blake3     the digest alone, no copy: blake3 of every source file (read from the disk)
  hash sha256     the same with hashlib's sha256 (SHA-NI where the CPU has it)

`cores busy` is the method's CPU time over its wall time (median of the rounds): how well
copy and hash overlap. On a shared machine run it as root under `nice -n -20` (recorded in
the output): every method, `cp` included, then takes the CPU ahead of other users' work.

The two hash rows bound what staging can reach: it must move the bytes as `cp` does and
also hash each of them, so on a machine whose cores are busy its throughput tends to
1 / (1/cp + 1/hash) of the CPU-bound rates, and only with a free core for the hash can it
approach `cp` itself.

`--cpus 0 0,1` runs everything (cp too: children inherit the affinity) once on CPU 0 alone,
then on CPUs 0 and 1: what one more core buys each method, i.e. how staging scales towards
`cp` where a node has cores to spare.

    .venv/bin/python bench/staging_vs_cp.py [--gb 1 4] [--files 4] [--rounds 3] [--dir DIR]
        [--cpus 0 0,1]

Prints a markdown table and writes bench/results/staging_vs_cp.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import write_results  # noqa: E402
from hpcserve.modelcache.cache import NodeCache  # noqa: E402
from hpcserve.modelcache.locks import filesystem_type  # noqa: E402
from hpcserve.modelcache.manifest import Manifest, build_manifest, hash_file  # noqa: E402
from hpcserve.modelcache.stage import stage  # noqa: E402

BLOCK = 64 << 20


def make_source(src: Path, total: int, nfiles: int) -> None:
    rng = np.random.default_rng(0)
    src.mkdir()
    for i in range(nfiles):
        left = total // nfiles
        with open(src / f"model-{i:05d}-of-{nfiles:05d}.safetensors", "wb") as f:
            while left:
                n = min(BLOCK, left)
                f.write(rng.bytes(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')


def files_under(path: Path) -> list[Path]:
    return [Path(d) / n for d, _, names in os.walk(path) for n in names]


def for_each_file(path: Path, fn: Callable[[int], None], flags: int = os.O_RDONLY) -> None:
    for p in files_under(path):
        fd = os.open(p, flags)
        try:
            fn(fd)
        finally:
            os.close(fd)


def drop_from_page_cache(path: Path) -> None:
    for_each_file(path, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def flush_and_delete(path: Path) -> None:
    for_each_file(path, os.fsync)
    drop_from_page_cache(path)
    shutil.rmtree(path)


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its waited-for children so far."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of fn()."""
    start, cpu = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - start, cpu_seconds() - cpu


def methods(src: Path, manifest: Manifest) -> dict[str, Callable[[Path], None]]:
    def cp(dst: Path) -> None:
        subprocess.run(["cp", "-r", str(src), str(dst)], check=True)

    def cp_fsync(dst: Path) -> None:
        cp(dst)
        for_each_file(dst, os.fsync)

    def staged(durable: bool) -> Callable[[Path], None]:
        def run(dst: Path) -> None:
            cache = NodeCache(dst)
            stage(manifest, src, cache, name="bench", version=1, durable=durable)

        return run

    def hash_only(algorithm: str) -> Callable[[Path], None]:
        def run(dst: Path) -> None:
            for f in manifest.files:
                hash_file(src / f.path, algorithm, 16 << 20, None)

        return run

    return {
        "cp -r": cp,
        "cp -r + fsync": cp_fsync,
        "stage": staged(False),
        "stage + fsync": staged(True),
        "hash blake3": hash_only("blake3"),
        "hash sha256": hash_only("sha256"),
    }


def run_rounds(
    src: Path, work: Path, manifest: Manifest, rounds: int
) -> dict[str, list[tuple[float, float]]]:
    cases = methods(src, manifest)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*cases, "verify hit"]}
    for r in range(rounds):
        for name, fn in cases.items():
            dst = work / f"out-{r}-{len(times[name])}-{name.replace(' ', '_')}"
            drop_from_page_cache(src)
            times[name].append(timed(lambda fn=fn, dst=dst: fn(dst)))
            if name == "stage":
                drop_from_page_cache(dst)
                times["verify hit"].append(
                    timed(
                        lambda dst=dst: stage(
                            manifest, src, NodeCache(dst), name="bench", version=1
                        )
                    )
                )
            if dst.exists():
                flush_and_delete(dst)
            print(f"round {r + 1}: {name}: {times[name][-1][0]:.2f}s", file=sys.stderr)
    return times


def machine() -> dict[str, str]:
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    import blake3

    flags = next(
        (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), ""
    ).split()
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores" + (", SHA-NI" if "sha_ni" in flags else ""),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "blake3": blake3.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--gb", type=float, nargs="+", default=[2.0], help="total size(s) of the model files"
    )
    ap.add_argument("--files", type=int, default=4, help="number of weight files")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work directory (default: the system temp dir)")
    ap.add_argument(
        "--cpus",
        nargs="+",
        default=None,
        help="CPU sets to pin the whole run to, one after the other (e.g. 0 0,1)",
    )
    args = ap.parse_args()
    cpu_sets = [parse_cpus(c) for c in args.cpus] if args.cpus else [None]
    load_before = os.getloadavg()
    results = []
    for gb in args.gb:
        with tempfile.TemporaryDirectory(prefix="hpcserve-bench-", dir=args.dir) as tmp:
            work = Path(tmp)
            src = work / "src"
            make_source(src, int(gb * 1e9), args.files)
            manifest = build_manifest(src)
            for cpus in cpu_sets:
                if cpus is not None:
                    pin_process(cpus)
                meta = {
                    **machine(),
                    "filesystem": filesystem_type(work) or "?",
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "command": "bench/staging_vs_cp.py " + " ".join(sys.argv[1:]),
                    "bytes": manifest.total_bytes,
                    "files": len(manifest.files),
                    "rounds": args.rounds,
                    "cpus": sorted(os.sched_getaffinity(0)),
                    "nice": os.nice(0),
                }
                times = run_rounds(src, work, manifest, args.rounds)
                results.append((meta, times))
    load = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    report(results, load, label_sizes=len(args.gb) > 1, label_cpus=len(cpu_sets) > 1)


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (blake3's pool threads, started by the
    manifest's hashing, would keep their own affinity); children inherit it."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def parse_cpus(text: str) -> set[int]:
    try:
        cpus = {int(c) for c in text.split(",")}
    except ValueError:
        raise SystemExit(f"--cpus: {text!r} is not a comma-separated list of CPU numbers") from None
    if not cpus or not cpus <= os.sched_getaffinity(0):
        raise SystemExit(f"--cpus: {text!r} names CPUs this process may not use")
    return cpus


def _gb(meta: dict[str, object]) -> float:
    return int(meta["bytes"]) / 1e9  # type: ignore[call-overload]


def rows_for(
    meta: dict[str, object], times: dict[str, list[tuple[float, float]]], label: str
) -> list[dict[str, object]]:
    gb = _gb(meta)
    med = {name: statistics.median(t for t, _ in runs) for name, runs in times.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in times.items()}
    return [
        {
            "method": f"{name}{label}",
            "gb": round(gb, 2),
            "median_s": round(m, 3),
            "gb_per_s": round(gb / m, 3),
            "throughput_vs_cp": round(med["cp -r"] / m, 3),
            "throughput_vs_cp_fsync": round(med["cp -r + fsync"] / m, 3),
            "cpu_s_per_gb": round(cpu[name] / gb, 3),
            "cores_busy": round(statistics.median(c / t for t, c in times[name]), 2),
            "runs_s": [round(t, 3) for t, _ in times[name]],
        }
        for name, m in med.items()
    ]


def report(
    results: list[tuple[dict[str, object], dict[str, list[tuple[float, float]]]]],
    load: list[float],
    label_sizes: bool,
    label_cpus: bool = False,
) -> None:
    rows = []
    for meta, times in results:
        parts = [f"{_gb(meta):.2f} GB"] if label_sizes else []
        if label_cpus:
            n = len(meta["cpus"])  # type: ignore[arg-type]
            parts.append(f"{n} core" + ("s" if n > 1 else ""))
        label = f" ({', '.join(parts)})" if parts else ""
        rows += rows_for(meta, times, label)
    meta = {**results[0][0], "sizes_bytes": [m["bytes"] for m, _ in results], "loadavg": load}
    meta["cpu_sets"] = [m["cpus"] for m, _ in results]
    out = write_results("staging_vs_cp", {"rows": rows}, meta)
    sizes = ", ".join(dict.fromkeys(f"{_gb(m):.2f} GB" for m, _ in results))
    print(
        f"\n{sizes} in {meta['files']} files each, {meta['filesystem']}, {meta['cpu']}, "
        f"medians of {meta['rounds']}, nice {meta['nice']}; "
        f"load average before {load[:3]}, after {load[3:]}\n"
    )
    print(
        "| method | GB | median s | GB/s | vs `cp -r` | vs `cp -r` + fsync | CPU s/GB "
        "| cores busy |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['method']} | {r['gb']} | {r['median_s']:.2f} | {r['gb_per_s']:.2f} | "
            f"{r['throughput_vs_cp']:.2f} | {r['throughput_vs_cp_fsync']:.2f} | "
            f"{r['cpu_s_per_gb']:.2f} | {r['cores_busy']:.2f} |"
        )
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
