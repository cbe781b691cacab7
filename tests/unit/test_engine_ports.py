"""An engine's ports taken before vLLM bound them (engine_launch/engine_ports.py)."""

import logging
import re
import socket
from pathlib import Path

import pytest

from hpcserve.engine_launch.engine import EngineFailed, EngineOptions, EngineRunner
from hpcserve.engine_launch.engine_ports import (
    HTTP,
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
            # The KV-event sockets are ipc:// in a private directory: no ports.
            EngineSpec("/m", "m", "vllm", "python", "10.0.0.5", 20001, kv_events_dir="/tmp/kv"),
            False,
            [EnginePort(HTTP, 20001, False, "10.0.0.5")],
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
GIVEN = EnginePort(HTTP, 8000, False)
MASTER_PORT = EnginePort(MASTER, 29500, False)


@pytest.mark.parametrize(
    ("taken", "retries_done", "retry"),
    [
        ([], 0, False),
        ([HTTP_PORT], 0, True),
        ([HTTP_PORT], PORT_RETRIES - 1, True),
        ([HTTP_PORT], PORT_RETRIES, False),  # gave up
        ([GIVEN], 0, False),  # --port: not the engine's to change
        ([HTTP_PORT, MASTER_PORT], 0, False),  # the other ranks already use the master port
    ],
)
def test_can_retry(taken: list[EnginePort], retries_done: int, retry: bool) -> None:
    assert can_retry(taken, retries_done) is retry


@pytest.mark.parametrize(
    ("taken", "retries_done", "message"),
    [
        (
            [HTTP_PORT],
            PORT_RETRIES,
            "vLLM exited: the HTTP server's port 20001 is in use by another process "
            f"(Address already in use); gave up after {PORT_RETRIES} restart(s) of vLLM on new "
            "ports",
        ),
        (
            [GIVEN, MASTER_PORT],
            0,
            "vLLM exited: the HTTP server's port 8000 and the torch.distributed rendezvous's "
            "port 29500 are in use by another process (Address already in use); port 8000, "
            "port 29500 was given to the engine, so it is not replaced: free it or pass another",
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
    ports = [HTTP_PORT, MASTER_PORT]
    taken = taken_ports(ports, lambda p: p.port != 20001)
    assert taken == [HTTP_PORT]
    spec = EngineSpec("/m", "m", "vllm", "python", "0.0.0.0", 20001)
    assert respec(spec, {HTTP: 21001}).port == 21001


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
    assert {r.port for r in runner.reservations} == {runner.port}
    taken = runner.port
    foreign = _listen(taken)
    try:
        with caplog.at_level(logging.WARNING):
            runner.launch_vllm()
        assert runner.port != taken
        assert f"the HTTP server's port {taken} is in use by another process" in caplog.text
        assert "retry 1 of" in caplog.text
        assert {r.port for r in runner.reservations} == {runner.port}
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
