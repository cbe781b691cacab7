"""Time of one engine step: the roofline core the planner and the simulator share.

An engine step runs a batch through the model once: some prompt tokens (prefill, possibly
a chunk of a longer prompt) and one new token for each decoding sequence. ``StepBatch``
describes that batch by sums over its sequences, so a simulator builds one per step from
its sequences (``prefill_chunk(...) + decode_step(...)``) and a planner can pass averages.
Anything with ``step_time(StepBatch) -> StepTime`` is a ``StepModel``: the ``Roofline``
here, or measured figures (calibrate.py). TTFT, TPOT and throughput are derived from it.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from hpcserve.planner.dtypes import BYTES_PER_ELEMENT, UNQUANTISED_BYTES
from hpcserve.planner.factors import Factors
from hpcserve.planner.replica import Replica, kv_bytes_per_token_per_gpu

ACTIVATION_BYTES = 2.0  # bf16 activations, what the TP all-reduces move


class StepBatch(msgspec.Struct, frozen=True):
    """The work of one engine step, summed over its sequences (floats: averages allowed)."""

    decode_seqs: float = 0.0  # sequences producing one token each
    decode_kv_tokens: float = 0.0  # sum of their context lengths (KV tokens they attend to)
    prefill_tokens: float = 0.0  # prompt tokens computed in this step
    prefill_seqs: float = 0.0  # prompt chunks in this step
    prefill_attn_pairs: float = 0.0  # causal query-key pairs of those chunks
    prefill_kv_read_tokens: float = 0.0  # cached context the chunks attend to (earlier chunks)

    @property
    def tokens(self) -> float:
        return self.decode_seqs + self.prefill_tokens

    def __add__(self, other: StepBatch) -> StepBatch:
        fields = self.__struct_fields__
        return StepBatch(*(getattr(self, f) + getattr(other, f) for f in fields))


def decode_step(seqs: float, context: float) -> StepBatch:
    """``seqs`` sequences each producing one token after ``context`` tokens."""
    return StepBatch(decode_seqs=seqs, decode_kv_tokens=seqs * context)


def prefill_chunk(tokens: float, offset: float = 0.0) -> StepBatch:
    """One prompt chunk of ``tokens`` starting after ``offset`` already-cached tokens."""
    pairs = tokens * offset + tokens * (tokens + 1) / 2
    return StepBatch(
        prefill_tokens=tokens,
        prefill_seqs=1.0,
        prefill_attn_pairs=pairs,
        prefill_kv_read_tokens=offset,
    )


class StepTime(msgspec.Struct, frozen=True):
    """How long a step takes, and (for the roofline) what bounds it."""

    total_s: float
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    overhead_s: float = 0.0
    bound: str = "measured"  # "compute", "memory" or "measured"


class StepModel(Protocol):
    @property
    def basis(self) -> str: ...

    def step_time(self, batch: StepBatch) -> StepTime: ...


class Roofline:
    """Step time of a replica from its roofline: the slower of compute and memory traffic.

    Per GPU (the TP group works in lockstep, each on 1/TP of every matrix and KV head):

    - bytes = (layer weights read + lm_head) / TP + KV bytes read and written. A dense model
      reads every layer weight each step; a MoE reads the shared weights and the experts its
      T tokens touch, E x (1 - (1 - k/E)^T) per layer for top-k of E. The input embedding is
      a gather and is not counted.
    - flops = (2 x active layer params x tokens + 2 x lm_head params x sequences
      + 4 x layers x heads x head dim x attended query-key pairs) / TP.
    - compute_s = flops / (peak x compute_efficiency), peak fp8 for fp8 weights on a GPU
      with fp8 tensor cores, else bf16 (int4 and fp8-on-A100 are weight-only: bf16 math).
    - memory_s = bytes / (HBM bandwidth x hbm_efficiency).
    - comm_s (TP > 1) = 2 all-reduces per layer of tokens x hidden x 2 bytes, each
      allreduce_latency_s + 2 (TP-1)/TP x bytes / (one-way link x interconnect_efficiency),
      the link being internode_gb_s when TP spans nodes.
    - total = max(compute_s, memory_s) + comm_s + step_overhead_s; an empty step takes 0.

    Failure mode: it is a bound scaled by typical efficiencies, so it is optimistic where
    kernels are poor for a shape or dtype (dequantisation, attention at long context) and
    blind to scheduler stalls; ``--calibrate`` replaces it with measurements.
    """

    def __init__(self, replica: Replica, factors: Factors | None = None) -> None:
        self.replica = replica
        self.factors = factors or Factors()
        model, gpu = replica.model, replica.gpu
        weight_bytes = BYTES_PER_ELEMENT[replica.weights_dtype]
        self._shared_bytes = model.shared_layer_params * weight_bytes
        self._expert_bytes = model.layers * model.expert_params_per_layer * weight_bytes
        self._lm_head_bytes = model.lm_head_params * UNQUANTISED_BYTES
        self._kv_per_token = kv_bytes_per_token_per_gpu(replica)
        routed = model.layers * model.experts_per_token * model.expert_params_per_layer
        self._active_layer_params = model.shared_layer_params + routed
        self._attn_flops_per_pair = 4 * model.layers * model.heads * model.head_dim
        fp8 = replica.weights_dtype == "fp8" and gpu.fp8_tflops > 0
        self.peak_flops = (gpu.fp8_tflops if fp8 else gpu.bf16_tflops) * 1e12
        self._link_bytes_s = (
            self.factors.internode_gb_s if replica.crosses_node else gpu.link_gb_s_one_way
        ) * 1e9

    @property
    def basis(self) -> str:
        return "roofline"

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts per layer that ``tokens`` routed tokens use."""
        model = self.replica.model
        if model.experts == 1:
            return 1.0 if tokens > 0 else 0.0
        miss = (1 - model.experts_per_token / model.experts) ** tokens
        return model.experts * (1 - miss)

    def bytes_per_gpu(self, batch: StepBatch) -> float:
        weights = self._shared_bytes + self._lm_head_bytes
        weights += self._expert_bytes * self.experts_touched(batch.tokens)
        kv_tokens = batch.decode_kv_tokens + batch.prefill_kv_read_tokens + batch.tokens
        return weights / self.replica.tp + kv_tokens * self._kv_per_token

    def flops_per_gpu(self, batch: StepBatch) -> float:
        linear = 2 * self._active_layer_params * batch.tokens
        logits = 2 * self.replica.model.lm_head_params * (batch.decode_seqs + batch.prefill_seqs)
        pairs = batch.decode_kv_tokens + batch.prefill_attn_pairs
        return (linear + logits + self._attn_flops_per_pair * pairs) / self.replica.tp

    def comm_s(self, batch: StepBatch) -> float:
        tp = self.replica.tp
        if tp == 1:
            return 0.0
        payload = batch.tokens * self.replica.model.hidden_size * ACTIVATION_BYTES
        ring = 2 * (tp - 1) / tp * payload
        one = self.factors.allreduce_latency_s + ring / (
            self._link_bytes_s * self.factors.interconnect_efficiency
        )
        return 2 * self.replica.model.layers * one

    def step_time(self, batch: StepBatch) -> StepTime:
        if batch.tokens <= 0:
            return StepTime(0.0, bound="memory")
        f, gpu = self.factors, self.replica.gpu
        compute = self.flops_per_gpu(batch) / (self.peak_flops * f.compute_efficiency)
        memory = self.bytes_per_gpu(batch) / (gpu.hbm_gb_s * 1e9 * f.hbm_efficiency)
        comm = self.comm_s(batch)
        total = max(compute, memory) + comm + f.step_overhead_s
        bound = "compute" if compute > memory else "memory"
        return StepTime(total, compute, memory, comm, f.step_overhead_s, bound)

    def single_stream_bound_tps(self, context: float) -> float:
        """Hard upper bound for one stream: peak HBM bandwidth / bytes read per decode step."""
        return self.replica.gpu.hbm_gb_s * 1e9 / self.bytes_per_gpu(decode_step(1, context))


def tpot_s(model: StepModel, batch: int, context: float) -> float:
    """Time per output token of each of ``batch`` sequences decoding at ``context``."""
    return model.step_time(decode_step(batch, context)).total_s


def ttft_s(
    model: StepModel, prompt: int, *, token_budget: int, running: int = 0, context: float = 0.0
) -> float:
    """Time to first token of one prompt, prefilled in chunks of the step's token budget.

    Each chunk shares its step with ``running`` decoding sequences at ``context``, which take
    ``running`` tokens of the budget. Waiting for a free slot (queueing) is not included.
    """
    chunk = max(1, token_budget - running)
    total, offset = 0.0, 0
    while offset < prompt:
        tokens = min(chunk, prompt - offset)
        batch = prefill_chunk(tokens, offset) + decode_step(running, context)
        total += model.step_time(batch).total_s
        offset += tokens
    return total


def prefill_tokens_per_s(model: StepModel, prompt: int, *, token_budget: int) -> float:
    return prompt / ttft_s(model, prompt, token_budget=token_budget)
