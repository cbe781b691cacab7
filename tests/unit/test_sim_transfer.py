"""The simulated engine as a prefill or decode replica (sim/transfer.py): what it answers,
what the decode skips and charges, and what its counters say, as vLLM's would."""

from __future__ import annotations

import argparse
import asyncio
import re

import pytest

from hpcserve.config import parse_config
from hpcserve.poolmgr.spec import build_job_spec
from hpcserve.sim.engine import SimConfig, SimEngine
from hpcserve.sim.options import OptionsError, add_arguments, sim_config
from hpcserve.sim.timing import fixed_hardware
from hpcserve.sim.tokenizer import WordTokenizer
from hpcserve.sim.transfer import KVTransferConfig, parse

PREFILL_S_PER_TOKEN = 0.01  # a 64-token prompt: 0.64 modelled seconds to compute
KV_BYTES = 1e6  # per token: 64 tokens are 512 Mb, 0.512 s over a 1 Gb/s link


def _engine(role: str = "", gbps: float = 1.0) -> SimEngine:
    hw = fixed_hardware(
        PREFILL_S_PER_TOKEN, 0.001, kv_blocks=100, block_size=16, kv_bytes_per_token=KV_BYTES
    )
    transfer = KVTransferConfig("SimConnector", role, gbps, 0.0) if role else None
    # A modelled second is a millisecond of wall time.
    return SimEngine(SimConfig("m", hw, time_scale=0.001, kv_transfer=transfer), WordTokenizer())


def _counters(engine: SimEngine) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in engine.metrics.text().decode().splitlines():
        if line.startswith("vllm:prompt_tokens") and "_created" not in line:
            name = line.split(" ", 1)[0]
            match = re.search(r'source="(\w+)"', name)
            key = name.split("{", 1)[0] + (f":{match.group(1)}" if match else "")
            out[key] = float(line.rsplit(" ", 1)[1])
        if line.startswith("vllm:nixl_xfer_time_seconds_sum"):
            out["xfer_s"] = float(line.rsplit(" ", 1)[1])
    return out


async def _run(engine: SimEngine, prompt: list[int], tokens: int, params: dict | None = None):
    req = engine.submit(prompt, tokens, kv_params=params)
    async for _ in engine.stream(req):
        pass
    return req


PROMPT = list(range(100, 164))  # 64 tokens: four full blocks of 16


def test_a_prefill_step_answers_the_parameters_a_decode_needs_and_the_decode_skips_the_prompt():
    prefill, decode = _engine("kv_producer"), _engine("kv_consumer")

    async def both():
        await prefill.start()
        await decode.start()
        try:
            step = await _run(prefill, PROMPT, 1, {"do_remote_decode": True})
            params = prefill.kv_transfer_answer(step)
            assert params is not None
            req = await _run(decode, PROMPT, 8, params)
            return step, params, req
        finally:
            await prefill.stop()
            await decode.stop()

    step, params, req = asyncio.run(both())
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [step.block_ids] and len(step.block_ids) == 4
    assert params["remote_num_tokens"] == 64
    assert len(req.output_ids) == 8 and req.external_tokens == 64 and req.cached_tokens == 0
    p, d = _counters(prefill), _counters(decode)
    assert p["vllm:prompt_tokens_by_source_total:local_compute"] == 64  # computed there
    assert p["vllm:prompt_tokens_by_source_total:external_kv_transfer"] == 0
    assert d["vllm:prompt_tokens_total"] == 64
    assert d["vllm:prompt_tokens_by_source_total:external_kv_transfer"] == 64
    assert d["vllm:prompt_tokens_by_source_total:local_compute"] == 0  # no recompute
    assert d["vllm:prompt_tokens_cached_total"] == 64
    # The transfer is charged (64 tokens x 1 MB at 1 Gb/s) instead of the prompt's compute
    # (64 x 10 ms): the decode computed the last prompt token and 7 decode steps only.
    assert d["xfer_s"] == pytest.approx(0.512)
    assert req.first_token_s - req.arrival_s >= 0.512
    assert prefill.busy_s == pytest.approx(64 * PREFILL_S_PER_TOKEN)
    assert decode.busy_s == pytest.approx(PREFILL_S_PER_TOKEN + 7 * 0.001)


def test_the_decode_transfers_only_what_its_own_prefix_cache_lacks():
    decode = _engine("kv_consumer")

    async def run():
        await decode.start()
        try:
            await _run(decode, PROMPT[:40] + [7] * 24, 2)  # caches two blocks of PROMPT
            return await _run(
                decode, PROMPT, 2, {"do_remote_prefill": True, "remote_block_ids": [[0]]}
            )
        finally:
            await decode.stop()

    req = asyncio.run(run())
    assert req.cached_tokens == 32 and req.external_tokens == 32
    d = _counters(decode)
    assert d["vllm:prompt_tokens_by_source_total:local_cache_hit"] == 32
    assert d["vllm:prompt_tokens_by_source_total:external_kv_transfer"] == 32
    assert d["xfer_s"] == pytest.approx(32 * KV_BYTES * 8 / 1e9)


def test_without_a_connector_the_parameters_are_ignored_as_by_vllm():
    engine = _engine()

    async def run():
        await engine.start()
        try:
            params = {"do_remote_prefill": True, "remote_block_ids": [[0]]}
            return await _run(engine, PROMPT, 2, params)
        finally:
            await engine.stop()

    req = asyncio.run(run())
    assert req.external_tokens == 0 and engine.kv_transfer_answer(req) is None
    assert _counters(engine)["vllm:prompt_tokens_by_source_total:local_compute"] == 64


def test_a_decode_request_whose_transfer_is_abandoned_never_runs():
    decode = _engine("kv_consumer", gbps=1e-6)  # the transfer takes ages

    async def run():
        await decode.start()
        try:
            req = decode.submit(
                PROMPT, 2, kv_params={"do_remote_prefill": True, "remote_block_ids": [[0]]}
            )
            assert decode.load().waiting == 1  # waiting for its KV, as vLLM counts it
            stream = decode.stream(req)
            task = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await stream.aclose()
            return req
        finally:
            await decode.stop()

    req = asyncio.run(run())
    assert req.finish_reason == "abort" and not decode.scheduler.has_work


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "not JSON"),
        ('{"kv_role": "kv_producer"}', "kv_connector"),
        ('{"kv_connector": "X", "kv_role": "kv_sideways"}', "kv_role 'kv_sideways'"),
    ],
)
def test_a_bad_kv_transfer_config_is_refused_naming_the_flag(text, error):
    with pytest.raises(ValueError, match=f"--kv-transfer-config: .*{error}"):
        parse(text, 100.0, 0.1)


def test_the_link_flags_are_checked_and_vllms_connector_configs_are_taken():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    example = '{"kv_connector":"ExampleConnector","kv_role":"kv_consumer"}'
    args = parser.parse_args(["--served-model-name", "m", "--kv-transfer-config", example])
    config = sim_config(args)
    assert config.kv_transfer is not None and config.kv_transfer.role == "kv_consumer"
    assert config.hardware.kv_bytes_per_token > 0  # the catalog model's (llama-3.1-8b)
    args.sim_kv_link_gbps = 0.0
    with pytest.raises(OptionsError, match="--sim-kv-link-gbps"):
        sim_config(args)


def test_a_sim_pool_pairs_rendered_arguments_make_a_prefill_and_a_decode_engine():
    """What the pool manager renders into a sim prefill / decode pool's job (poolmgr/spec.py,
    contracts/engine_args.py) is what the simulated engine reads."""
    base = {"model_path": "/m", "engine": "sim", "served_model_name": "chat"}
    config = parse_config(
        {
            "pools": [
                {**base, "name": "chat-prefill", "role": "prefill"},
                {**base, "name": "chat-decode", "role": "decode"},
            ]
        }
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    roles = []
    for pool in config.pools:
        spec = build_job_spec(config, pool)
        args, _ = parser.parse_known_args(["--served-model-name", "chat", *spec.engine_args])
        transfer = sim_config(args).kv_transfer
        assert transfer is not None and transfer.connector == "SimConnector"
        roles.append(transfer.role)
    assert roles == ["kv_producer", "kv_consumer"]
