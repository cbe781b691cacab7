"""What the simulated GPU is: the planner's catalogs and roofline, or a fixed cost per token.

``hardware(...)`` resolves a GPU from the planner's catalog (gpus.py) and a model (a
catalog name from models.py, or a directory / config.json read by ``from_hf_config``) into
a ``SimHardware``: the planner's ``Roofline`` step model and the KV blocks that fit, by the
planner's own ``memory_fit``. The simulator and the capacity planner therefore price the
same step the same way. ``FixedStep`` is the plain alternative (a set cost per prompt token
and per decode step), for tests that want timing independent of any hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcserve.planner.dtypes import KV_DTYPES, WEIGHTS_DTYPES
from hpcserve.planner.factors import Factors
from hpcserve.planner.gpus import get_gpu
from hpcserve.planner.models import ModelSpec, resolve_model
from hpcserve.planner.perfmodel import Roofline, StepBatch, StepModel, StepTime
from hpcserve.planner.replica import Replica, check_tp, kv_bytes_per_token, memory_fit


class FixedStep:
    """A step costs ``prefill_s_per_token`` per prompt token plus ``decode_s`` when any
    sequence decodes; no hardware behind it."""

    def __init__(self, prefill_s_per_token: float, decode_s: float) -> None:
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s = decode_s

    @property
    def basis(self) -> str:
        return "fixed"

    def step_time(self, batch: StepBatch) -> StepTime:
        if batch.tokens <= 0:
            return StepTime(0.0)
        total = batch.prefill_tokens * self.prefill_s_per_token
        if batch.decode_seqs > 0:
            total += self.decode_s
        return StepTime(total)


@dataclass(frozen=True)
class SimHardware:
    step_model: StepModel
    kv_blocks: int
    block_size: int
    description: str
    max_context: int = 0
    # The model's KV cache per token, whole model (2 x layers x KV heads x head dim x bytes):
    # what a prefill replica hands a decode replica per prompt token (sim/transfer.py).
    kv_bytes_per_token: float = 0.0


def hardware(
    gpu: str,
    model: str | ModelSpec,
    *,
    tp: int = 1,
    factors: Factors | None = None,
    num_blocks_override: int = 0,
    weights_dtype: str = "bf16",
    kv_dtype: str = "bf16",
) -> SimHardware:
    """The roofline and KV capacity of ``model`` on ``tp`` GPUs of type ``gpu``.

    Raises PlanError (from the planner) naming the flag for an unknown GPU or model, a TP
    that does not split the heads, or weights that do not fit.
    """
    from hpcserve.planner.errors import PlanError

    spec = resolve_model(model) if isinstance(model, str) else model
    gpu_spec = get_gpu(gpu, flag="--sim-gpu")
    check_tp(spec, tp, flag="--tensor-parallel-size")
    if weights_dtype not in WEIGHTS_DTYPES:
        raise PlanError(
            f"--sim-weights-dtype: {weights_dtype!r}; allowed: {', '.join(WEIGHTS_DTYPES)}"
        )
    if kv_dtype not in KV_DTYPES:
        raise PlanError(f"--sim-kv-dtype: {kv_dtype!r}; allowed: {', '.join(KV_DTYPES)}")
    factors = factors or Factors()
    replica = Replica(spec, gpu_spec, tp, weights_dtype, kv_dtype)  # type: ignore[arg-type]
    fit = memory_fit(replica, factors)
    blocks = num_blocks_override or fit.kv_blocks
    if blocks < 1:
        raise PlanError(
            f"--sim-model: {spec.name} does not fit on {tp} x {gpu_spec.name} "
            f"({fit.weights_bytes_per_gpu / 2**30:.1f} GiB of weights per GPU)"
        )
    return SimHardware(
        Roofline(replica, factors),
        blocks,
        fit.kv_block_tokens,
        f"{spec.name} ({weights_dtype}, KV {kv_dtype}) on {tp} x {gpu_spec.name}",
        spec.max_context,
        kv_bytes_per_token(spec, kv_dtype),
    )


def fixed_hardware(
    prefill_s_per_token: float,
    decode_s: float,
    *,
    kv_blocks: int,
    block_size: int,
    kv_bytes_per_token: float = 0.0,
) -> SimHardware:
    return SimHardware(
        FixedStep(prefill_s_per_token, decode_s),
        kv_blocks,
        block_size,
        f"fixed timing: {prefill_s_per_token * 1e3:g} ms per prompt token, "
        f"{decode_s * 1e3:g} ms per decode step",
        kv_bytes_per_token=kv_bytes_per_token,
    )
