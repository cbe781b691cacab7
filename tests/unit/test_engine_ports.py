"""An engine's ports taken before vLLM bound them (engine_launch/engine_ports.py)."""

import logging
import re
import socket
from pathlib import Path

import pytest

from hpcserve.engine_launch.engine import EngineFailed, EngineOptions, EngineRunner
from hpcserve.engine_launch.engine_ports import (
    HTTP,
    KV_EVENTS,
    KV_REPLAY,
    MASTER,
    PORT_RETRIES,
    EnginePort,
    can_retry,
    describe_taken,
    engine_ports,
    port_failure,
    respec,
    taken_ports,
)
from hpcserve.engine_launch.vllm_args import EngineSpec
from tests.ports import free_port

SPEC = EngineSpec("/m", "m", "vllm", "python", "0.0.0.0", 20001)


@pytest.mark.parametrize(
    ("spec", "http_chosen", "expected"),
    [
        (SPEC, True, [EnginePort(HTTP, 20001, True)]),
        (
            EngineSpec("/m", "m", "vllm", "python", "10.0.0.5", 20001, kv_events_port=20002,
                       kv_replay_port=20003),
            False,
            [EnginePort(HTTP, 20001, False, "10.0.0.5"), EnginePort(KV_EVENTS, 20002, True),
             EnginePort(KV_REPLAY, 20003, True)],
        ),
        (
            EngineSpec("/m", "m", "vllm", "python", "0.0.0.0", 20001, nnodes=2,
                       master_addr="n1", master_port=29500),
            True,
            [EnginePort(HTTP, 20001, True), EnginePort(MASTER, 29500, False)],
        ),
    ],
)  # fmt: skip
def test_engine_ports(spec: EngineSpec, http_chosen: bool, expected: list[EnginePort]) -> None:
    assert engine_ports(spec, http_chosen=http_chosen) == expected


HTTP_PORT = EnginePort(HTTP, 20001, True)
KV_PORT = EnginePort(KV_EVENTS, 20002, True)
GIVEN = EnginePort(HTTP, 8000, False)
MASTER_PORT = EnginePort(MASTER, 29500, False)


@pytest.mark.parametrize(
    ("taken", "retries_done", "retry"),
    [
        ([], 0, False),
        ([KV_PORT], 0, True),
        ([HTTP_PORT, KV_PORT], PORT_RETRIES - 1, True),
        ([KV_PORT], PORT_RETRIES, False),  # gave up
        ([GIVEN], 0, False),  # --port: not the engine's to change
        ([KV_PORT, MASTER_PORT], 0, False),  # the other ranks already use the master port
    ],
)
def test_can_retry(taken: list[EnginePort], retries_done: int, retry: bool) -> None:
    assert can_retry(taken, retries_done) is retry


@pytest.mark.parametrize(
    ("taken", "retries_done", "message"),
    [
        (
            [KV_PORT],
            PORT_RETRIES,
            "vLLM exited: the KV-event publisher's port 20002 is in use by another process "
            f"(Address already in use); gave up after {PORT_RETRIES} restart(s) of vLLM on new "
            "ports",
        ),
        (
            [GIVEN, KV_PORT],
            0,
            "vLLM exited: the HTTP server's port 8000 and the KV-event publisher's port 20002 "
            "are in use by another process (Address already in use); port 8000 was given to "
            "the engine, so it is not replaced: free it or pass another",
        ),
    ],
)
def test_port_failure_names_the_port_and_the_socket(
    taken: list[EnginePort], retries_done: int, message: str
) -> None:
    assert port_failure("vLLM exited", taken, retries_done) == message


def test_describe_one_port() -> None:
    assert describe_taken([MASTER_PORT]) == (
        "the torch.distributed rendezvous's port 29500 is in use by another process "
        "(Address already in use)"
    )


def test_taken_ports_and_respec() -> None:
    ports = [HTTP_PORT, KV_PORT, EnginePort(KV_REPLAY, 20003, True)]
    taken = taken_ports(ports, lambda p: p.port != 20002)
    assert taken == [KV_PORT]
    spec = EngineSpec("/m", "m", "vllm", "python", "0.0.0.0", 20001, kv_events_port=20002,
                      kv_replay_port=20003)  # fmt: skip
    new = respec(spec, {KV_EVENTS: 21002, HTTP: 21001})
    assert (new.port, new.kv_events_port, new.kv_replay_port) == (21001, 21002, 20003)


# The real engine supervision, with the simulated engine (a process that binds its ports at
# start, as vLLM does after loading the model), against a foreign process's socket.


def _runner(tmp_path: Path, port: int = 0) -> EngineRunner:
    options = EngineOptions(
        str(tmp_path), "m", f"tcp://127.0.0.1:{free_port()}", engine="sim",
        bind_host="127.0.0.1", port=port, ready_timeout_s=600,
    )  # fmt: skip
    runner = EngineRunner(options)
    runner.port_grace_s = 0  # the foreign socket stays: no need to wait for it to go
    return runner


def _listen(port: int, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((host, port))
    sock.listen()
    return sock


def test_a_chosen_port_taken_before_vllm_binds_it_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = _runner(tmp_path)
    reserved = {r.port for r in runner.reservations}
    assert reserved == {runner.port, runner.spec.kv_events_port, runner.spec.kv_replay_port}
    taken = runner.spec.kv_events_port
    foreign = _listen(taken, "0.0.0.0")
    try:
        with caplog.at_level(logging.WARNING):
            runner.launch_vllm()
        assert runner.spec.kv_events_port != taken
        assert f"the KV-event publisher's port {taken} is in use by another process" in (
            caplog.text
        )
        assert "retry 1 of" in caplog.text
        assert {r.port for r in runner.reservations} == {
            runner.port, runner.spec.kv_events_port, runner.spec.kv_replay_port
        }  # fmt: skip
    finally:
        foreign.close()
        assert runner.stop_vllm() == 0
        runner.release_ports()
    assert runner.reservations == []


def test_a_given_port_taken_fails_the_engine_with_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    foreign = _listen(port)
    runner = _runner(tmp_path, port=port)
    try:
        with pytest.raises(EngineFailed) as failed:
            runner.launch_vllm()
    finally:
        foreign.close()
        runner.stop_vllm()
        runner.release_ports()
    assert re.fullmatch(
        r"vLLM exited with code \d+ before it was ready: "
        + re.escape(
            f"the HTTP server's port {port} is in use by another process (Address already in "
            f"use); port {port} was given to the engine, so it is not replaced: free it or pass "
            "another"
        ),
        str(failed.value),
    )
