"""Precisions of weights and KV cache, and their bytes per element."""

from __future__ import annotations

from typing import Literal, get_args

WeightsDtype = Literal["fp16", "bf16", "fp8", "int4"]
KVDtype = Literal["fp16", "bf16", "fp8"]

WEIGHTS_DTYPES: tuple[str, ...] = get_args(WeightsDtype)
KV_DTYPES: tuple[str, ...] = get_args(KVDtype)

# int4 is the packed payload only: group-wise scales (e.g. one fp16 per 128 weights,
# +3%) are not counted; see memory.py for which weights stay in 16 bit.
BYTES_PER_ELEMENT: dict[str, float] = {"fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int4": 0.5}

# Embeddings, lm_head and norms stay in 16 bit in quantised checkpoints (AWQ, GPTQ, FP8).
UNQUANTISED_BYTES = 2.0
