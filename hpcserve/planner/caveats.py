"""What would make each section's estimates wrong, and the warnings a plan raises."""

from __future__ import annotations

from hpcserve.planner.factors import Factors
from hpcserve.planner.replica import Replica


def memory_caveats(replica: Replica, factors: Factors) -> list[str]:
    notes = [
        f"the engine's real activation and CUDA-graph memory differs from the assumed "
        f"{factors.runtime_overhead_gib:g} GiB per GPU (vLLM profiles it at start)",
        "prefix caching shares KV between requests with a common prefix: more sequences fit",
        "the catalog memory is the driver's total; ECC, MIG or other processes take some",
    ]
    if replica.weights_dtype in ("int4", "fp8"):
        notes.append(
            f"{replica.weights_dtype} checkpoints carry scales (int4 with group 128: ~3%) and "
            "may keep more layers in 16 bit than embeddings and lm_head"
        )
    if replica.model.sliding_window:
        notes.append(
            f"the model uses a {replica.model.sliding_window}-token sliding window: KV at "
            "longer contexts is overestimated here (full attention assumed)"
        )
    return notes


def performance_caveats(calibrated: bool, factors: Factors) -> list[str]:
    if calibrated:
        return [
            "measured figures hold for the context, prompt lengths, engine version and "
            "settings of the measurement, not others",
            "between and beyond measured batch sizes the step time is interpolated / "
            "tokens/s held flat",
        ]
    return [
        f"efficiency factors are typical, not measured here (HBM {factors.hbm_efficiency:g}, "
        f"compute {factors.compute_efficiency:g}, {factors.step_overhead_s * 1e3:g} ms per "
        "step): --calibrate replaces them",
        "kernels for this dtype, shape and GPU may be slower (int4 dequantisation, fp8 on "
        "A100 is weight-only, attention at long context)",
        "speculative decoding, CUDA graphs off or a different scheduler change step times",
        "TTFT leaves out queueing for a free slot and the network",
    ]


def fleet_caveats(mode: str, factors: Factors) -> list[str]:
    notes = [
        f"traffic bursts beyond the {1 - factors.sizing_load:.0%} headroom (sizing_load "
        f"{factors.sizing_load:g}) queue requests and stretch TTFT",
        "routing is assumed to balance replicas evenly",
    ]
    if mode == "streams":
        notes.append(
            "streams mode models decode only, every sequence at the full context: new "
            "prompts' prefill takes step time too"
        )
    else:
        notes.append(
            "mean prompt and output lengths stand for their distributions; long tails need "
            "more KV and raise TPOT"
        )
    return notes


def batch_caveats() -> list[str]:
    return [
        "every replica is assumed to stay at full batch for the whole job; the tail, "
        "model loading (minutes) and failed jobs are not counted",
        "mean document lengths stand for their distribution",
    ]


def economics_caveats(placeholder_price: bool) -> list[str]:
    notes = [
        "GPU-hour price only: no storage, network, power beyond it, or staff",
        "input and output tokens are priced as if the GPUs did only prefill or only decode",
        "utilisation is a guess about your traffic, not a property of the fleet",
    ]
    if placeholder_price:
        notes.insert(0, "the $/GPU-hour is a placeholder: pass --gpu-hour-usd")
    return notes
