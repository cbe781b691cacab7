"""The engine checks: the one-token generation probe against a real HTTP server, and the
token-progress rule over vLLM's /metrics text."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hpcserve.health.engine_checks import (
    Counters,
    GenerationProbe,
    TokenProgress,
    busy_not_broken,
    parse_counters,
)


class Engine:
    """A stand-in HTTP engine: which paths answer 200, and how slowly."""

    def __init__(self) -> None:
        self.serves = {"/v1/completions"}
        self.bodies: list[dict[str, object]] = []
        # Cleared: the engine holds every answer until it is set again (or the test ends).
        self.answering = threading.Event()
        self.answering.set()
        self.answered = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                engine.bodies.append(json.loads(self.rfile.read(length)))
                engine.answering.wait(60)
                status = 200 if self.path in engine.serves else 400
                body = b"{}"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                engine.answered += 1

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.answering.set()
    e.server.shutdown()
    e.server.server_close()


def test_probe_generates_one_greedy_token(engine: Engine) -> None:
    probe = GenerationProbe(engine.url, "m")
    result = probe.run(60)
    assert result.ok and result.detail == ""
    assert engine.bodies == [{"model": "m", "prompt": "ok", "max_tokens": 1, "temperature": 0}]


def test_probe_finds_what_a_pooling_model_serves(engine: Engine) -> None:
    engine.serves = {"/v1/embeddings"}
    probe = GenerationProbe(engine.url, "m")
    assert probe.run(60).ok
    assert probe.run(60).ok
    paths = [sorted(b) for b in engine.bodies]
    assert paths == [["max_tokens", "model", "prompt", "temperature"], ["input", "model"],
                     ["input", "model"]]  # fmt: skip
    engine.serves = {"/rerank"}
    assert GenerationProbe(engine.url, "m").run(60).ok


def test_probe_misses_its_deadline(engine: Engine) -> None:
    engine.answering.clear()
    result = GenerationProbe(engine.url, "m").run(0.5)
    assert not result.ok
    assert result.detail == "no answer within 0.5s" and result.timed_out
    assert engine.answered == 0, "it gave up before the answer came"


def test_probe_of_a_dead_engine_or_one_that_refuses_everything(engine: Engine) -> None:
    engine.serves = set()
    # It answers, so it is up; no probe fits the model: not a finding (the counters decide).
    result = GenerationProbe(engine.url, "m").run(60)
    assert result.ok and result.detail.startswith("cannot probe: engine refused every probe")
    known = GenerationProbe(engine.url, "m")
    engine.serves = {"/v1/completions"}
    assert known.run(60).ok
    engine.serves = set()
    assert known.run(60).detail == "/v1/completions answered 400"
    url = engine.url
    engine.server.shutdown()
    engine.server.server_close()
    result = GenerationProbe(url, "m").run(2)
    assert not result.ok and "unreachable" in result.detail


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
"""


def test_counters_from_vllm_metrics() -> None:
    assert parse_counters(METRICS) == Counters(tokens=160.0, running=3, waiting=1)
    assert parse_counters("") == Counters(tokens=0.0, running=0)
    assert parse_counters("vllm:num_requests_running{} x\n") == Counters(0.0, 0)


@pytest.mark.parametrize(
    ("readings", "expected"),
    [
        # (seconds, tokens, running) -> finding after the last reading
        ([(0, 10, 2), (10, 20, 2), (20, 30, 2)], ""),
        ([(0, 10, 2), (10, 10, 2), (29, 10, 2)], ""),
        ([(0, 10, 2), (10, 10, 2), (30, 10, 2)], "no tokens for 30s with 2 running"),
        ([(0, 10, 2), (30, 10, 0), (60, 10, 0)], ""),  # idle is not stalled
        ([(0, 10, 0), (20, 10, 1), (45, 10, 1)], "no tokens for 45s with 1 running"),
        ([(0, 10, 2), (40, 10, 2), (41, 11, 2)], ""),  # moved again
    ],
)
def test_token_progress(readings: list[tuple[float, float, int]], expected: str) -> None:
    progress = TokenProgress(stall_s=30)
    result = ""
    for now, tokens, running in readings:
        result = progress.update(Counters(tokens, running), now)
    assert result == expected


@pytest.mark.parametrize(
    ("before", "after", "busy"),
    [
        (Counters(100, 4, 9), Counters(180, 4, 9), True),  # a queue, and tokens flow
        (Counters(100, 4, 9), Counters(100, 4, 9), False),  # a queue, nothing moves: hung
        (Counters(100, 4, 0), Counters(180, 4, 0), False),  # nothing waits: the probe should run
        (None, Counters(180, 4, 9), False),  # no reading before the probe
        (Counters(100, 4, 9), None, False),  # /metrics did not answer either
    ],
)
def test_a_probe_that_timed_out_behind_a_moving_queue_is_busy_not_broken(
    before: Counters | None, after: Counters | None, busy: bool
) -> None:
    assert busy_not_broken(before, after) is busy
