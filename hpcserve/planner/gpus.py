"""GPU catalog: the datasheet figures the roofline needs, one frozen struct per GPU type.

Figures are vendor datasheet peaks: dense (no 2:4 sparsity) tensor FLOP/s, HBM bandwidth,
and the GPU-to-GPU link's total (both directions) bandwidth. Memory is what the driver
reports as total (nvidia-smi / rocm-smi), a little under the marketing "GB". Achievable
rates are lower; the efficiency factors in factors.py account for that.
"""

from __future__ import annotations

import msgspec

from hpcserve.planner.errors import PlanError


class GPUSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One GPU type. ``fp8_tflops`` is 0 where the GPU has no fp8 tensor cores."""

    name: str
    memory_gib: float  # total device memory as the driver reports it
    hbm_gb_s: float  # peak memory bandwidth, 1e9 bytes/s
    bf16_tflops: float  # dense bf16/fp16 tensor peak, 1e12 FLOP/s
    fp8_tflops: float  # dense fp8 tensor peak; 0 = none (fp8 weights then run as bf16 math)
    interconnect: str
    interconnect_gb_s: float  # per GPU, both directions together, as datasheets quote it
    gpus_per_node: int = 8

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 1024**3

    @property
    def link_gb_s_one_way(self) -> float:
        """Bandwidth one way, what a ring all-reduce step moves data at."""
        return self.interconnect_gb_s / 2


GPUS: dict[str, GPUSpec] = {
    # NVIDIA H100 SXM5 80GB datasheet: 3.35 TB/s HBM3, BF16 1,979 TFLOPS with sparsity
    # (989 dense), FP8 3,958 sparse (1,979 dense), NVLink4 900 GB/s. nvidia-smi: 81,559 MiB.
    "h100": GPUSpec("H100 SXM 80GB", 79.6, 3350, 989, 1979, "NVLink4", 900),
    # NVIDIA H200 SXM 141GB datasheet: 4.8 TB/s HBM3e, same compute as H100, NVLink4 900 GB/s.
    # nvidia-smi: 143,771 MiB.
    "h200": GPUSpec("H200 SXM 141GB", 140.4, 4800, 989, 1979, "NVLink4", 900),
    # NVIDIA HGX B200 datasheet, per GPU (an eighth of the board): 180 GB HBM3e at 8 TB/s,
    # FP16/BF16 4.5 PFLOPS sparse (2.25 dense), FP8 9 sparse (4.5 dense), NVLink5 1.8 TB/s.
    # nvidia-smi: about 183,000 MiB.
    "b200": GPUSpec("B200 180GB", 179.0, 8000, 2250, 4500, "NVLink5", 1800),
    # NVIDIA A100 SXM4 80GB datasheet: 2,039 GB/s HBM2e, BF16 312 dense (624 sparse),
    # no fp8 tensor cores, NVLink3 600 GB/s. nvidia-smi: 81,920 MiB.
    "a100": GPUSpec("A100 SXM 80GB", 80.0, 2039, 312, 0, "NVLink3", 600),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, BF16 362 dense (733 sparse), FP8 733
    # dense, no NVLink: PCIe Gen4 x16, 64 GB/s both ways. nvidia-smi: 46,068 MiB.
    "l40s": GPUSpec("L40S 48GB", 45.0, 864, 362, 733, "PCIe Gen4 x16", 64),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, BF16 1,307 dense TFLOPS, FP8
    # 2,615 dense; Infinity Fabric 7 peer links x 128 GB/s = 896 GB/s. rocm-smi: ~191.5 GiB.
    "mi300x": GPUSpec("MI300X 192GB", 191.5, 5300, 1307, 2615, "Infinity Fabric (xGMI)", 896),
}


def get_gpu(name: str, *, flag: str = "--gpu") -> GPUSpec:
    """The catalog entry for ``name`` (case-insensitive); PlanError listing the catalog if none."""
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise PlanError(f"{flag}: unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    return spec
