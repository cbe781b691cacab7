"""The simulated engine's --stream-interval (vLLM's): a stream sends the first token at once,
then every N tokens and the last, the same text and usage in fewer events."""

from __future__ import annotations

import argparse
import json
import random

import pytest
from starlette.testclient import TestClient

from hpcserve.sim.engine import SimConfig, SimEngine
from hpcserve.sim.options import OptionsError, add_arguments, sim_config
from hpcserve.sim.server import build_app
from hpcserve.sim.timing import fixed_hardware
from hpcserve.sim.tokenizer import WordTokenizer


def _stream(interval: int, max_tokens: int) -> tuple[list[str], dict[str, int]]:
    """The content of each streamed event (the role event left out) and the usage."""
    hw = fixed_hardware(0.0, 0.0, kv_blocks=100, block_size=16)
    engine = SimEngine(SimConfig("m", hw, stream_interval=interval), WordTokenizer())
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    contents: list[str] = []
    usage: dict[str, int] = {}
    with TestClient(build_app(engine, rng=random.Random(7))) as client:
        answer = client.post("/v1/chat/completions", json=body)
    for line in answer.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            if "content" in choice["delta"] and "role" not in choice["delta"]:
                contents.append(choice["delta"]["content"])
    return contents, usage


@pytest.mark.parametrize(
    ("interval", "max_tokens", "events"),
    [
        (1, 7, 7),  # every token
        (3, 7, 3),  # the first, then tokens 2-4, then 5-7 (the last)
        (4, 7, 3),  # the first, 2-5, then 6-7: the last sent short
        (10, 7, 2),  # the first, then the rest at the end
        (10, 1, 1),  # one token: the first is the last
    ],
)
def test_tokens_go_out_in_groups(interval: int, max_tokens: int, events: int) -> None:
    contents, usage = _stream(interval, max_tokens)
    every, _ = _stream(1, max_tokens)
    assert len(contents) == events
    assert "".join(contents) == "".join(every)  # the same text
    assert usage["completion_tokens"] == max_tokens


def test_the_interval_is_checked() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--served-model-name", "m", "--decode-ms-per-token", "1", "--stream-interval", "0"]
    )
    with pytest.raises(OptionsError, match="--stream-interval: must be >= 1, got 0"):
        sim_config(args)
