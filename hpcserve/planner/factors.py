"""Every assumed factor of the planner, named, defaulted and explained in one place.

These are typical figures for a well-tuned engine (vLLM with CUDA graphs) on datacenter
GPUs, not measurements of this stack: ``--calibrate`` replaces the throughput side with
measured figures. Change one with ``Factors(hbm_efficiency=0.7, ...)``.
"""

from __future__ import annotations

import msgspec

from hpcserve.planner.errors import PlanError

_FRACTIONS = (
    "gpu_memory_utilization",
    "hbm_efficiency",
    "compute_efficiency",
    "interconnect_efficiency",
    "sizing_load",
)
_POSITIVE = ("kv_block_tokens", "min_kv_seqs", "max_num_seqs", "max_num_batched_tokens")
_NON_NEGATIVE = ("runtime_overhead_gib", "allreduce_latency_s", "step_overhead_s")


class Factors(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The planner's assumptions. Raises PlanError naming a factor that is out of range."""

    # Memory
    gpu_memory_utilization: float = 0.90  # share of GPU memory the engine takes (vLLM default)
    runtime_overhead_gib: float = 2.0  # per GPU, out of that share: activations, CUDA graphs
    kv_block_tokens: int = 16  # paged-KV block size (vLLM default); sequences round up to it
    min_kv_seqs: int = 8  # auto TP: a "useful" KV budget holds this many full-context sequences
    # Time of one engine step (perfmodel.py)
    hbm_efficiency: float = 0.80  # achieved / peak HBM bandwidth in decode
    compute_efficiency: float = 0.50  # achieved / peak dense tensor FLOP/s (MFU) in prefill
    interconnect_efficiency: float = 0.70  # achieved / peak one-way link bandwidth, all-reduce
    allreduce_latency_s: float = 10e-6  # fixed cost of one small all-reduce within a node
    internode_gb_s: float = 50.0  # per GPU, one way, when TP spans nodes (400 Gb/s InfiniBand)
    step_overhead_s: float = 1e-3  # scheduling, sampling, launch gaps: per step, not per token
    # Engine limits (vLLM's --max-num-seqs, --max-num-batched-tokens)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Fleet sizing: replicas run at most at this share of their modelled capacity at the target
    sizing_load: float = 0.85

    def __post_init__(self) -> None:
        for name in _FRACTIONS:
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise PlanError(f"factors.{name}: must be in (0, 1], got {value}")
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise PlanError(f"factors.{name}: must be >= 1, got {getattr(self, name)}")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise PlanError(f"factors.{name}: must be >= 0, got {getattr(self, name)}")
        if self.internode_gb_s <= 0:
            raise PlanError(f"factors.internode_gb_s: must be > 0, got {self.internode_gb_s}")
