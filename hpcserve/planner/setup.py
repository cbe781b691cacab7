"""The resolved inputs of a plan (replica, memory, step model) and the workload bound to them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hpcserve.planner.capacity import Limits, OperatingPoint, requests_point, streams_point
from hpcserve.planner.factors import Factors
from hpcserve.planner.perfmodel import Roofline, StepModel
from hpcserve.planner.replica import MemoryFit, Replica, memory_fit
from hpcserve.planner.request import PlanRequest


@dataclass
class Setup:
    request: PlanRequest
    factors: Factors
    replica: Replica
    fit: MemoryFit
    model: StepModel
    tp_reason: str = ""
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def roofline(cls, request: PlanRequest, factors: Factors, replica: Replica) -> Setup:
        fit = memory_fit(replica, factors)
        return cls(request, factors, replica, fit, Roofline(replica, factors))

    @property
    def calibrated(self) -> bool:
        return not isinstance(self.model, Roofline)

    @property
    def prompt_tokens(self) -> int:
        """The prompt TTFT is given for: the workload's, else a full-context one."""
        return self.request.prompt_tokens or self.request.context

    @property
    def sequence_tokens(self) -> int:
        """Tokens a sequence reaches: prompt + output for requests, else the context."""
        shape = self.request.request_shape
        return sum(shape) if shape else self.request.context

    @property
    def decode_context(self) -> int:
        """Context of a decoding sequence: on average prompt + output / 2 for requests."""
        shape = self.request.request_shape
        return shape[0] + shape[1] // 2 if shape else self.request.context

    def max_batch(self, sequence_tokens: int | None = None) -> tuple[int, str]:
        """Largest batch: what the KV cache holds, capped by the engine's max_num_seqs."""
        kv = self.fit.max_seqs(sequence_tokens or self.sequence_tokens)
        if kv <= self.factors.max_num_seqs:
            return kv, "KV cache"
        return self.factors.max_num_seqs, "max_num_seqs"

    def limits(self, max_batch: int) -> Limits:
        """TPOT within the SLO and the per-stream rate; TTFT within its SLO."""
        req = self.request
        tpots = [req.tpot_slo_ms / 1e3] if req.tpot_slo_ms else []
        if req.tokens_per_s_each:
            tpots.append(1 / req.tokens_per_s_each)
        ttft = req.ttft_slo_ms / 1e3 if req.ttft_slo_ms else None
        return Limits(max_batch, min(tpots) if tpots else None, ttft)

    def point_at(self) -> Callable[[int], OperatingPoint]:
        """The replica's operating point at a batch size for this request's workload."""
        req, budget = self.request, self.factors.max_num_batched_tokens
        if req.request_shape:
            prompt, output = req.request_shape
            return lambda batch: requests_point(
                self.model, batch, prompt=prompt, output=output, token_budget=budget
            )
        return lambda batch: streams_point(
            self.model, batch, context=req.context, prompt=self.prompt_tokens, token_budget=budget
        )
