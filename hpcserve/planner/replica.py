"""One replica (a model on TP GPUs of one type) and what fits in its memory.

Weights: transformer-layer parameters x bytes of the weights dtype, plus embeddings, lm_head
and norms in 16 bit (quantised checkpoints keep them so), split evenly over TP GPUs.
KV cache per token: 2 (K and V) x layers x KV heads x head dim x bytes of the KV dtype.
Each GPU holds KV heads / TP of them, or one (replicated) when TP exceeds the KV heads.
KV budget per GPU: memory x gpu_memory_utilization - runtime overhead - weights per GPU, cut
into paged blocks of ``kv_block_tokens``; a sequence of C tokens takes ceil(C / block) blocks.
"""

from __future__ import annotations

import math

import msgspec

from hpcserve.planner.dtypes import BYTES_PER_ELEMENT, UNQUANTISED_BYTES, KVDtype, WeightsDtype
from hpcserve.planner.errors import PlanError
from hpcserve.planner.factors import Factors
from hpcserve.planner.gpus import GPUSpec
from hpcserve.planner.models import ModelSpec

GIB = 1024**3


class Replica(msgspec.Struct, frozen=True):
    """A model served on ``tp`` GPUs with tensor parallelism, in the given precisions."""

    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    weights_dtype: WeightsDtype = "bf16"
    kv_dtype: KVDtype = "bf16"

    @property
    def crosses_node(self) -> bool:
        return self.tp > self.gpu.gpus_per_node

    @property
    def kv_heads_per_gpu(self) -> int:
        return max(1, self.model.kv_heads // self.tp)


def kv_bytes_per_token(model: ModelSpec, kv_dtype: str) -> float:
    """2 x layers x KV heads x head dim x bytes per element, for the whole model."""
    return 2 * model.layers * model.kv_heads * model.head_dim * BYTES_PER_ELEMENT[kv_dtype]


def kv_bytes_per_token_per_gpu(replica: Replica) -> float:
    model = replica.model
    per_element = BYTES_PER_ELEMENT[replica.kv_dtype]
    return 2 * model.layers * replica.kv_heads_per_gpu * model.head_dim * per_element


def weights_bytes(model: ModelSpec, weights_dtype: str) -> float:
    """All weights: layers in the weights dtype, embeddings, lm_head and norms in 16 bit."""
    layers = model.layer_params_total * BYTES_PER_ELEMENT[weights_dtype]
    return layers + model.embedding_params * UNQUANTISED_BYTES


class MemoryFit(msgspec.Struct, frozen=True):
    """Memory of one GPU of a replica; every GPU holds 1/TP of each KV block."""

    usable_bytes_per_gpu: float  # memory x gpu_memory_utilization - runtime overhead
    weights_bytes_per_gpu: float
    kv_budget_bytes_per_gpu: float  # usable - weights; negative: the weights do not fit
    kv_bytes_per_token_per_gpu: float
    kv_block_tokens: int
    kv_blocks: int

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.kv_block_tokens

    def blocks_per_seq(self, context: int) -> int:
        return math.ceil(context / self.kv_block_tokens)

    def max_seqs(self, context: int) -> int:
        """Sequences of ``context`` tokens whose KV fits at once."""
        return self.kv_blocks // self.blocks_per_seq(context)


def memory_fit(replica: Replica, factors: Factors) -> MemoryFit:
    usable = (
        replica.gpu.memory_bytes * factors.gpu_memory_utilization
        - factors.runtime_overhead_gib * GIB
    )
    weights = weights_bytes(replica.model, replica.weights_dtype) / replica.tp
    budget = usable - weights
    per_token = kv_bytes_per_token_per_gpu(replica)
    blocks = max(0, int(budget // (per_token * factors.kv_block_tokens)))
    return MemoryFit(usable, weights, budget, per_token, factors.kv_block_tokens, blocks)


def check_tp(model: ModelSpec, tp: int, *, flag: str = "--tp") -> None:
    """TP must split attention heads evenly, and KV heads evenly or into whole copies."""
    if tp < 1:
        raise PlanError(f"{flag}: must be >= 1, got {tp}")
    if model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
        raise PlanError(
            f"{flag}: {tp} does not split {model.name}'s {model.heads} attention heads and "
            f"{model.kv_heads} KV heads evenly; allowed: {', '.join(map(str, tp_options(model)))}"
        )


def tp_options(model: ModelSpec, limit: int = 64) -> list[int]:
    """Powers of two up to ``limit`` that split the model's heads evenly."""
    options = []
    tp = 1
    while tp <= limit:
        if not model.heads % tp and (not model.kv_heads % tp or not tp % model.kv_heads):
            options.append(tp)
        tp *= 2
    return options
