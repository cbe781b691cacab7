"""``--calibrate FILE``: measured throughput that replaces the roofline's bounds.

The file is JSON (documented in docs/planner.md)::

    {"format": "hpcserve-calibration/1", "model": "llama-3.1-8b", "gpu": "h100", "tp": 1,
     "weights_dtype": "bf16", "kv_dtype": "bf16", "context": 2048,
     "prefill_tokens_per_s": 18000,
     "decode": [{"batch": 1, "tokens_per_s": 150}, {"batch": 64, "tokens_per_s": 5200}],
     "source": "bench/... on node gpu17, vLLM 0.11, 2026-12-01"}

``decode[].tokens_per_s`` is the output tokens/s of the whole replica with ``batch``
sequences decoding at about ``context`` tokens each; ``prefill_tokens_per_s`` is prompt
tokens/s of the replica prefilling alone. Memory (KV capacity) is still computed.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Annotated, Literal

import msgspec

# the config's "path: expected ..., got value" wording
from hpcserve.config import humanize_validation_error
from hpcserve.planner.dtypes import KVDtype, WeightsDtype
from hpcserve.planner.errors import PlanError
from hpcserve.planner.gpus import GPUS
from hpcserve.planner.perfmodel import StepBatch, StepTime
from hpcserve.planner.replica import Replica

FORMAT = "hpcserve-calibration/1"
PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]


class DecodePoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    batch: PosInt
    tokens_per_s: PosFloat  # output tokens/s of the whole replica


class Calibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: Literal["hpcserve-calibration/1"]
    model: str
    gpu: str
    tp: PosInt
    prefill_tokens_per_s: PosFloat
    decode: Annotated[list[DecodePoint], msgspec.Meta(min_length=1)]
    weights_dtype: WeightsDtype = "bf16"
    kv_dtype: KVDtype = "bf16"
    context: Annotated[int, msgspec.Meta(ge=0)] = 0  # context per sequence when measured
    source: str = ""


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file; PlanError naming the file and the bad field."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise PlanError(f"--calibrate: cannot read {path}: {err}") from None
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as err:
        raise PlanError(f"--calibrate {path}: not JSON: {err}") from None
    try:
        cal = msgspec.convert(raw, Calibration)
    except msgspec.ValidationError as err:
        raise PlanError(f"--calibrate {path}: {humanize_validation_error(err, raw)}") from None
    batches = [point.batch for point in cal.decode]
    if batches != sorted(set(batches)):
        raise PlanError(f"--calibrate {path}: decode[].batch must increase, got {batches}")
    if cal.gpu.lower() not in GPUS:
        raise PlanError(
            f"--calibrate {path}: gpu: unknown GPU {cal.gpu!r}; known: {', '.join(sorted(GPUS))}"
        )
    return cal


def check_matches(cal: Calibration, replica: Replica, *, path: str = "") -> None:
    """PlanError when the measurement was of another model, GPU, TP or precision."""
    planned = {
        "model": (replica.model.name.lower(), "--model"),
        "gpu": (replica.gpu.name, "--gpu"),
        "tp": (replica.tp, "--tp"),
        "weights_dtype": (replica.weights_dtype, "--weights-dtype"),
        "kv_dtype": (replica.kv_dtype, "--kv-dtype"),
    }
    measured = {
        "model": cal.model.lower(),
        "gpu": GPUS[cal.gpu.lower()].name,
        "tp": cal.tp,
        "weights_dtype": cal.weights_dtype,
        "kv_dtype": cal.kv_dtype,
    }
    for field, (value, flag) in planned.items():
        if measured[field] != value:
            raise PlanError(
                f"--calibrate {path}: {field}: measured {getattr(cal, field)!r} but the plan "
                f"uses {value!r} ({flag}); a calibration only applies to what it measured"
            )


class CalibratedModel:
    """Step times from measured throughput, in place of the roofline.

    Decode: the measured step time (batch / tokens_per_s) is interpolated linearly in batch
    between points; below the first point the first point's step time holds, above the last
    the last point's tokens/s holds (no gain is extrapolated). Prefill: tokens /
    prefill_tokens_per_s, added to the decode time of the step (no overlap assumed).
    Failure mode: context and prompt-length effects are frozen at the measured ones.
    """

    def __init__(self, cal: Calibration, *, label: str = "") -> None:
        self.cal = cal
        self._points = [(p.batch, p.batch / p.tokens_per_s) for p in cal.decode]
        self._label = label or cal.source or "calibration file"

    @property
    def basis(self) -> str:
        return f"measured ({self._label})"

    def decode_step_s(self, batch: float) -> float:
        if batch <= 0:
            return 0.0
        points = self._points
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in pairwise(points):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        last_batch, last_step = points[-1]
        return last_step * batch / last_batch

    def step_time(self, batch: StepBatch) -> StepTime:
        prefill = batch.prefill_tokens / self.cal.prefill_tokens_per_s
        return StepTime(self.decode_step_s(batch.decode_seqs) + prefill)
