"""Money: monthly cost, cost per million tokens at a utilisation, break-even against an API.

Input and output tokens are priced by time sharing: a million output tokens costs what the
fleet costs for the time it takes to decode them at its modelled decode rate, a million
input tokens likewise at its prefill rate, both divided by the average utilisation (the
share of capacity that traffic actually uses). Break-even utilisation is the utilisation
at which the self-hosted cost equals the API price: own cost at full use / API price.
"""

from __future__ import annotations

import msgspec

HOURS_PER_MONTH = 730.0  # 8,760 hours / 12


def monthly_cost_usd(gpus: int, usd_per_gpu_hour: float) -> float:
    return gpus * usd_per_gpu_hour * HOURS_PER_MONTH


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float, utilisation: float) -> float:
    return usd_per_hour / (tokens_per_s * 3600 * utilisation) * 1e6


def break_even_utilisation(own_usd_at_full_use: float, api_usd: float) -> float:
    """Utilisation at which self-hosting costs the API price; above 1: never breaks even."""
    return own_usd_at_full_use / api_usd


class Traffic(msgspec.Struct, frozen=True):
    """What the billed GPUs serve at full use: token rates, and requests of a known mix."""

    output_tokens_per_s: float
    input_tokens_per_s: float
    requests_per_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class Economics(msgspec.Struct, frozen=True):
    gpu_hour_usd: float
    utilisation: float
    gpus_billed: int
    monthly_usd: float
    usd_per_m_output: float
    usd_per_m_input: float
    api_usd_per_m_output: float | None = None
    api_usd_per_m_input: float | None = None
    break_even_output: float | None = None  # utilisation vs the API's output price alone
    break_even_input: float | None = None  # utilisation vs the API's input price alone
    break_even_workload: float | None = None  # utilisation vs the API's price of a request


def economics(
    traffic: Traffic,
    *,
    gpus_billed: int,
    gpu_hour_usd: float,
    utilisation: float,
    api_usd_per_m_input: float | None = None,
    api_usd_per_m_output: float | None = None,
) -> Economics:
    usd_h = gpus_billed * gpu_hour_usd
    out_full = usd_per_million_tokens(usd_h, traffic.output_tokens_per_s, 1.0)
    in_full = usd_per_million_tokens(usd_h, traffic.input_tokens_per_s, 1.0)
    api_out, api_in = api_usd_per_m_output, api_usd_per_m_input
    workload = None
    if api_out is not None and api_in is not None and traffic.requests_per_s:
        own_request = usd_h / 3600 / traffic.requests_per_s
        api_request = (
            (traffic.prompt_tokens or 0) * api_in + (traffic.output_tokens or 0) * api_out
        ) / 1e6
        workload = break_even_utilisation(own_request, api_request)
    return Economics(
        gpu_hour_usd=gpu_hour_usd,
        utilisation=utilisation,
        gpus_billed=gpus_billed,
        monthly_usd=monthly_cost_usd(gpus_billed, gpu_hour_usd),
        usd_per_m_output=out_full / utilisation,
        usd_per_m_input=in_full / utilisation,
        api_usd_per_m_output=api_out,
        api_usd_per_m_input=api_in,
        break_even_output=None if api_out is None else break_even_utilisation(out_full, api_out),
        break_even_input=None if api_in is None else break_even_utilisation(in_full, api_in),
        break_even_workload=workload,
    )
