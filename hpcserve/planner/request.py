"""What a plan is asked: model, GPU, precisions, workload, SLOs, prices; validated once.

Field names are the CLI flags with ``_`` for ``-`` (``tokens_per_s_each`` is
``--tokens-per-s-each``), and every error names the flag, the bad value and what is allowed.
"""

from __future__ import annotations

import msgspec

from hpcserve.planner.dtypes import KV_DTYPES, WEIGHTS_DTYPES
from hpcserve.planner.errors import PlanError
from hpcserve.planner.models import ModelSpec

DEFAULT_GPU_HOUR_USD = 2.5

_POSITIVE_INTS = (
    "context",
    "tp",
    "gpus_per_node",
    "concurrent_streams",
    "prompt_tokens",
    "output_tokens",
    "gpus",
    "batch",
    "batch_docs",
    "batch_input_tokens",
    "batch_output_tokens",
)
_POSITIVE_FLOATS = (
    "tokens_per_s_each",
    "requests_per_s",
    "ttft_slo_ms",
    "tpot_slo_ms",
    "gpu_hour_usd",
    "api_usd_per_m_input",
    "api_usd_per_m_output",
    "batch_window_h",
    "pd_link_gb_s",
)
_STREAMS = ("concurrent_streams", "tokens_per_s_each")
_REQUESTS = ("requests_per_s", "prompt_tokens", "output_tokens")
_BATCH = ("batch_docs", "batch_input_tokens", "batch_output_tokens")


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


class PlanRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A planning question. Raises PlanError naming the flag when a value is out of range
    or a workload is half given (streams: both of concurrent_streams and tokens_per_s_each;
    requests: requests_per_s, prompt_tokens and output_tokens; a batch job: all three
    batch_* sizes)."""

    model: str | ModelSpec
    gpu: str
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    context: int = 8192  # max tokens per sequence (prompt + output)
    tp: int | None = None  # None: the smallest that fits (or the calibration's)
    gpus_per_node: int | None = None  # None: the GPU catalog's (8)
    concurrent_streams: int | None = None
    tokens_per_s_each: float | None = None
    requests_per_s: float | None = None
    prompt_tokens: int | None = None  # requests workload; with streams, only for TTFT
    output_tokens: int | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    spares: int = 1
    gpus: int | None = None  # a GPU budget: its concurrency, and the batch job's wall-clock
    batch: int | None = None  # report TTFT/TPOT at this batch (default: the operating one)
    gpu_hour_usd: float | None = None  # None: DEFAULT_GPU_HOUR_USD, flagged as a placeholder
    utilisation: float = 0.6
    api_usd_per_m_input: float | None = None
    api_usd_per_m_output: float | None = None
    batch_docs: int | None = None
    batch_input_tokens: int | None = None
    batch_output_tokens: int | None = None
    batch_window_h: float | None = None
    calibrate: str | None = None  # path of a calibration file
    # Disaggregated prefill/decode (pd.py): compare with colocated replicas on the same GPUs.
    pd: bool = False
    pd_mix: str | None = None  # PROMPT:OUTPUT:SHARE,... (default: the requests workload)
    pd_link: str = "ib"  # a preset of pd.LINKS
    pd_link_gb_s: float | None = None  # override the preset's bandwidth
    pd_link_latency_us: float | None = None  # override the preset's per-transfer latency
    pd_per_token: bool = False  # TPOT SLO on every token gap (ITL p95), not a request's mean

    def __post_init__(self) -> None:
        _check_ranges(self)
        _check_workloads(self)
        _check_pd(self)

    @property
    def mode(self) -> str:
        """``streams``, ``requests`` or ``none``."""
        if self.concurrent_streams is not None:
            return "streams"
        return "requests" if self.request_shape else "none"

    @property
    def request_shape(self) -> tuple[int, int] | None:
        """(prompt, output) tokens of the requests workload; None for other workloads."""
        if self.requests_per_s is None or self.prompt_tokens is None:
            return None
        return (self.prompt_tokens, self.output_tokens) if self.output_tokens else None

    @property
    def batch_job(self) -> tuple[int, int, int] | None:
        """(documents, input tokens, output tokens) of the batch job, if one is given."""
        docs, prompt, output = self.batch_docs, self.batch_input_tokens, self.batch_output_tokens
        if docs is None or prompt is None or output is None:
            return None
        return docs, prompt, output


def _check_ranges(req: PlanRequest) -> None:
    if req.weights_dtype not in WEIGHTS_DTYPES:
        raise PlanError(
            f"--weights-dtype: {req.weights_dtype!r} is not one of {', '.join(WEIGHTS_DTYPES)}"
        )
    if req.kv_dtype not in KV_DTYPES:
        raise PlanError(f"--kv-dtype: {req.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    for field in _POSITIVE_INTS:
        value = getattr(req, field)
        if value is not None and (isinstance(value, bool) or value < 1):
            raise PlanError(f"{flag(field)}: must be a positive integer, got {value}")
    for field in _POSITIVE_FLOATS:
        value = getattr(req, field)
        if value is not None and not value > 0:
            raise PlanError(f"{flag(field)}: must be > 0, got {value}")
    if req.spares < 0:
        raise PlanError(f"--spares: must be >= 0, got {req.spares}")
    if not 0 < req.utilisation <= 1:
        raise PlanError(f"--utilisation: must be in (0, 1], got {req.utilisation}")


def _check_workloads(req: PlanRequest) -> None:
    _all_or_none(req, _STREAMS)
    if req.requests_per_s is not None or req.output_tokens is not None:
        _all_or_none(req, _REQUESTS)
    if req.concurrent_streams is not None and req.requests_per_s is not None:
        raise PlanError(
            "--concurrent-streams and --requests-per-s describe two workloads; give one"
        )
    _all_or_none(req, _BATCH)
    if req.batch_window_h is not None and req.batch_docs is None:
        raise PlanError("--batch-window-h: needs a batch job (--batch-docs ...)")
    shape, job = req.request_shape, req.batch_job
    if shape and sum(shape) > req.context:
        raise PlanError(
            f"--prompt-tokens + --output-tokens: {shape[0]} + {shape[1]} exceeds "
            f"--context {req.context}"
        )
    if job and job[1] + job[2] > req.context:
        raise PlanError(
            f"--batch-input-tokens + --batch-output-tokens: {job[1]} + {job[2]} exceeds "
            f"--context {req.context}"
        )


def _check_pd(req: PlanRequest) -> None:
    given = [f for f in ("pd_mix", "pd_link_gb_s", "pd_link_latency_us") if getattr(req, f)]
    if not req.pd:
        if given or req.pd_per_token:
            name = flag(given[0]) if given else "--pd-per-token"
            raise PlanError(f"{name}: only with --pd")
        return
    if req.pd_link_latency_us is not None and req.pd_link_latency_us < 0:
        raise PlanError(f"--pd-link-latency-us: must be >= 0, got {req.pd_link_latency_us}")
    missing = [flag(f) for f in ("ttft_slo_ms", "tpot_slo_ms") if getattr(req, f) is None]
    if missing:
        raise PlanError(f"--pd: needs {' and '.join(missing)} (goodput is counted within the SLO)")
    if req.pd_mix is None and req.request_shape is None:
        raise PlanError(
            "--pd: needs a request mix: --pd-mix, or --requests-per-s with --prompt-tokens and "
            "--output-tokens"
        )


def _all_or_none(req: PlanRequest, fields: tuple[str, ...]) -> None:
    missing = [flag(f) for f in fields if getattr(req, f) is None]
    if missing and len(missing) < len(fields):
        given = [flag(f) for f in fields if getattr(req, f) is not None]
        raise PlanError(f"{', '.join(given)}: also needs {', '.join(missing)}")
