"""The ports an engine's vLLM binds, and what to do when one was taken before vLLM bound it.

The engine reserves the ports it chooses host-wide (hpcserve/ports.py `reserve_ports`), so
no other hpcserve process on the host hands them out, but a foreign process can still bind
one between choice and bind: vLLM then exits with "Address already in use". When vLLM exits
before it is ready, the engine checks each of its ports the way vLLM binds them (with
SO_REUSEADDR, so its own closed connections do not count), again for a few seconds while
one is still held (vLLM's own exiting processes let go of theirs). A port taken by someone
else is named with its socket; if the engine chose every taken port it restarts vLLM on new
ones (up to `PORT_RETRIES` times, each restart loads the model again); a port it was given
(`--port`, or the master port of a multi-node replica, which the other ranks already use)
cannot be changed, so the engine fails with the message and the pool manager replaces the
job (a FAILED job: counted as a failure, resubmitted after the backoff).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hpcserve.engine_launch.vllm_args import EngineSpec

# Restarts of vLLM on new ports after a port was taken before vLLM bound it.
PORT_RETRIES = 2

HTTP = "HTTP server"
MASTER = "torch.distributed rendezvous"


@dataclass(frozen=True)
class EnginePort:
    socket: str
    port: int
    # Chosen by the engine (can be replaced), not given to it.
    chosen: bool
    # The address vLLM binds it on ("": every interface).
    host: str = ""


def engine_ports(spec: EngineSpec, *, http_chosen: bool) -> list[EnginePort]:
    """The ports vLLM (node rank 0) binds for `spec`."""
    http_host = "" if spec.bind_host in ("0.0.0.0", "*") else spec.bind_host
    # (The KV-event sockets are ipc://, in the engine's private directory: no ports.)
    ports = [EnginePort(HTTP, spec.port, http_chosen, http_host)]
    if spec.nnodes > 1 and spec.master_port:
        ports.append(EnginePort(MASTER, spec.master_port, False))
    return ports


def taken_ports(
    ports: Sequence[EnginePort], is_free: Callable[[EnginePort], bool]
) -> list[EnginePort]:
    return [p for p in ports if not is_free(p)]


def describe_taken(taken: Sequence[EnginePort]) -> str:
    """``"the HTTP server's port 23456 is in use by another process ..."``."""
    names = [f"the {p.socket}'s port {p.port}" for p in taken]
    verb = "is" if len(names) == 1 else "are"
    return f"{' and '.join(names)} {verb} in use by another process (Address already in use)"


def can_retry(taken: Sequence[EnginePort], retries_done: int) -> bool:
    """Restart vLLM on new ports: only for ports the engine chose, a bounded number of times."""
    return bool(taken) and all(p.chosen for p in taken) and retries_done < PORT_RETRIES


def port_failure(error: str, taken: Sequence[EnginePort], retries_done: int) -> str:
    """The engine's error when it gives up on a taken port."""
    given = [p for p in taken if not p.chosen]
    if given:
        why = (
            "; "
            + ", ".join(f"port {p.port}" for p in given)
            + (" was given to the engine, so it is not replaced: free it or pass another")
        )
    else:
        why = f"; gave up after {retries_done} restart(s) of vLLM on new ports"
    return f"{error}: {describe_taken(taken)}{why}"


def respec(spec: EngineSpec, new: dict[str, int]) -> EngineSpec:
    """`spec` with new ports (socket name -> port) for the sockets the engine chose."""
    field = {HTTP: "port"}
    ports: dict[str, Any] = {field[name]: port for name, port in new.items()}
    return replace(spec, **ports)


def bindable_like_vllm(port: EnginePort) -> bool:
    """Whether a listening socket could bind the port now, as vLLM's servers bind (uvicorn
    and ZeroMQ set SO_REUSEADDR, so connections left in TIME_WAIT do not block them)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((port.host, port.port))
        except OSError:
            return False
    return True
