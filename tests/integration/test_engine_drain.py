"""`hpcserve engine` supervising the simulated engine: registration, relay through the real
gateway with the official openai client, and a drain that loses no request in flight."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts.router_client import list_models, list_replicas
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.router.server import RouterServer
from tests.processes import processes_mentioning, session_processes

KEY = "sk-drain-test"


def wait_for(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def client(router: RouterServer) -> Iterator[openai.OpenAI]:
    config = GatewayConfig(api_keys=[ApiKey(tenant="t", sha256=hash_api_key(KEY))])
    gateway = Gateway(
        config, routing_endpoint=router.config.routing_bind, configured_models={"sim"}
    )
    with TestClient(build_app(gateway)) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
        )


def test_sim_replica_registers_and_serves_through_the_gateway(
    engine: subprocess.Popen[str], client: openai.OpenAI, router: RouterServer
) -> None:
    (replica,) = list_replicas(router.config.routing_bind)
    assert (replica.model, replica.pool) == ("sim", "simpool")
    reply = client.chat.completions.create(
        model="sim", max_tokens=3, messages=[{"role": "user", "content": "a b c"}]
    )
    assert reply.choices[0].message.content == " tok0 tok1 tok2"
    assert reply.usage is not None and reply.usage.prompt_tokens == 3
    chunks = list(client.completions.create(model="sim", prompt="x", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " tok0 tok1 tok2 tok3"


def test_engine_killed_hard_takes_its_engine_process_with_it(
    engine: subprocess.Popen[str], router: RouterServer
) -> None:
    url = list_replicas(router.config.routing_bind)[0].url
    engine.kill()
    engine.wait(10)
    port = url.rsplit(":", 1)[1]
    wait_for(lambda: processes_mentioning(f"--port {port}") == [])
    # The engine's keeper saw it go and ended the engine's session; once every process of
    # it is gone, nothing holds the log pipe any more.
    assert engine.stdout is not None
    log = engine.stdout.read()
    (session,) = re.findall(r"starting vLLM in session (\d+)", log)
    assert session_processes(int(session)) == []
    assert f"the engine (pid {engine.pid}) is gone: vLLM's process tree (session {session}" in log


def test_sigterm_leaves_routing_at_once_and_finishes_requests_in_flight(
    engine: subprocess.Popen[str], client: openai.OpenAI, router: RouterServer
) -> None:
    results: list[str] = []

    def long_request() -> None:
        reply = client.completions.create(model="sim", prompt="x", max_tokens=500)
        results.append(reply.choices[0].finish_reason)

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_for(lambda: list_replicas(router.config.routing_bind)[0].in_flight == 1)
    engine.send_signal(signal.SIGTERM)
    # Out of routing at once (within a heartbeat), while the request (5 s of decoding, past
    # what a loaded machine adds to that) still runs.
    wait_for(lambda: list_models(router.config.routing_bind) == [])
    assert worker.is_alive()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="sim", prompt="x", max_tokens=1)
    assert err.value.status_code == 503
    worker.join(60)
    assert results == ["length"], "the request in flight finished despite the drain"
    assert engine.wait(60) == 0
    assert engine.stdout is not None
    log = engine.stdout.read()
    assert "stop requested: SIGTERM" in log and "engine stopped (vLLM exit code 0)" in log
    (session,) = re.findall(r"starting vLLM in session (\d+)", log)
    assert "vLLM stopped: drained in " in log
    assert session_processes(int(session)) == []
