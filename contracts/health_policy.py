"""What each health finding means: the Xid table and the finding -> action policy (pure).

Actions, mildest first: log (a line and a counter), stop_routing (the replica leaves the
router; the engine stays up and rejoins when its checks pass again), drain (the replica
leaves routing and drains, and the node is drained in Slurm so nothing new lands there),
drain_reset (drain, then the site's reset hook asks for a GPU reset or a reboot).
"""

from __future__ import annotations

from collections.abc import Iterable

from hpcserve.contracts.protocol import HealthFinding

ACTIONS = ("log", "stop_routing", "drain", "drain_reset")
REASON_PREFIX = "hpcserve:"

# NVIDIA's Xid catalogue: errors that condemn the GPU (or its memory, NVLink, the bus)...
XID_FAULTS = frozenset(
    {48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 94, 95, 119, 120}
)
# ...and errors an application causes (bad address, illegal instruction): the GPU is fine.
XID_APPLICATION = frozenset({13, 31, 43, 45})

# Every check a finding can come from, with its default action.
CHECKS: dict[str, str] = {
    "xid": "log",  # the action comes from the Xid table
    "gpu_count": "drain",  # fewer GPUs than Slurm allocated
    "gpu_lost": "drain",  # NVML: GPU is lost / requires reset
    "nvml_error": "drain",  # NVML does not start, or fails on a device
    "ecc_uncorrectable": "drain",  # volatile uncorrectable ECC errors
    "remap_pending": "drain",  # a row remapping waits for a GPU reset
    "remap_failed": "drain",  # row remapping failed: the GPU needs service
    "retired_pages_pending": "drain",  # page retirement waits for a reset (pre-Ampere)
    "temperature": "log",
    "thermal_throttle": "log",
    "power_throttle": "log",
    "nvlink_down": "drain",
    "dcgm_failure": "drain",
    "dcgm_warning": "log",
    "engine_probe": "stop_routing",  # a one-token generation missed its deadline or failed
    "engine_stall": "stop_routing",  # running requests, token counters still
    # Greedy canary decodes differ from the version's golden record (contracts/canary.py):
    # other weights, an engine change, or silent data corruption ("drain" condemns the node).
    "numerical_canary": "stop_routing",
}


def severity(action: str) -> int:
    return ACTIONS.index(action)


def worst_action(findings: Iterable[HealthFinding]) -> str:
    return max((f.action for f in findings), key=severity, default="log")


def drain_reason(findings: Iterable[HealthFinding], limit: int = 200) -> str:
    """Slurm's reason for a node: 'hpcserve: xid 79 gpu 3' (worst first, then the rest)."""
    ordered = sorted(findings, key=lambda f: -severity(f.action))
    details = list(dict.fromkeys(f.detail for f in ordered))
    reason = f"{REASON_PREFIX} " + "; ".join(details)
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def drained_by_hpcserve(reason: str) -> bool:
    return reason.strip().startswith(REASON_PREFIX)
