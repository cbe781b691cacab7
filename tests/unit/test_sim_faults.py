"""The simulated engine's fault injection (--sim-error-rate): that share of completion
requests is answered 500 in vLLM's error shape, before any token; the flag is checked."""

from __future__ import annotations

import argparse
import random

import pytest
from starlette.testclient import TestClient

from hpcserve.sim.engine import SimConfig, SimEngine
from hpcserve.sim.options import OptionsError, add_arguments, sim_config
from hpcserve.sim.server import build_app
from hpcserve.sim.timing import fixed_hardware
from hpcserve.sim.tokenizer import WordTokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _client(error_rate: float) -> TestClient:
    hw = fixed_hardware(0.0, 0.0, kv_blocks=100, block_size=16)
    engine = SimEngine(SimConfig("m", hw, error_rate=error_rate), WordTokenizer())
    return TestClient(build_app(engine, rng=random.Random(7)))


def test_a_share_of_requests_fails_as_vllm_would() -> None:
    with _client(0.5) as client:
        answers = [client.post("/v1/chat/completions", json=CHAT) for _ in range(200)]
    failed = [a for a in answers if a.status_code == 500]
    assert 60 <= len(failed) <= 140  # seeded: about half
    assert {a.status_code for a in answers} == {200, 500}
    error = failed[0].json()["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)
    with _client(0.0) as client:
        assert all(
            client.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 200
            for _ in range(20)
        )


@pytest.mark.parametrize("rate", ["-0.1", "1.5"])
def test_the_rate_is_a_share(rate: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--served-model-name", "m", "--decode-ms-per-token", "1", "--sim-error-rate", rate]
    )
    with pytest.raises(OptionsError, match="--sim-error-rate: must be from 0 to 1"):
        sim_config(args)
