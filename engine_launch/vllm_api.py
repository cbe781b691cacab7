"""vLLM's API server on a listening socket the engine made:
`python -m hpcserve.engine_launch.vllm_api ARGS` with `HPCSERVE_HTTP_FD` in the environment
(ARGS: those of `python -m vllm.entrypoints.openai.api_server`).

vLLM binds its HTTP port itself (launcher.create_server_socket) in whatever network
namespace it runs in. In a namespace of its own (private_net.py) that port would be
reachable from nowhere, so the engine binds it in the node's namespace and passes the open
socket down; here vLLM's socket maker returns that socket instead of binding one. Only the
first call is answered so (vLLM makes one HTTP socket; a second would be another server).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from hpcserve.engine_launch.vllm_args import HTTP_FD_VARIABLE as FD_VARIABLE


def adopted_socket(fd: int) -> socket.socket:
    """The listening TCP socket open at `fd`; ValueError naming what is there otherwise."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as err:
        raise ValueError(f"{FD_VARIABLE}={fd}: no open socket there ({err.strerror})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ValueError(f"{FD_VARIABLE}={fd}: not a TCP socket ({sock.family!r}, {sock.type!r})")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ValueError(f"{FD_VARIABLE}={fd}: a TCP socket that is not listening")
    sock.set_inheritable(False)  # vLLM's own children must not hold the port
    return sock


def install(sock: socket.socket) -> None:
    """Make vLLM's socket maker return `sock` the first time it is called."""
    from vllm.entrypoints.launchers import launcher

    make_socket = launcher.create_server_socket
    given: list[socket.socket] = [sock]

    def engine_socket(addr: tuple[str, int], **kwargs: Any) -> socket.socket:
        return given.pop() if given else make_socket(addr, **kwargs)

    launcher.create_server_socket = engine_socket


def main() -> None:
    raw = os.environ.pop(FD_VARIABLE, "")
    if not raw.isdigit():
        sys.exit(f"{FD_VARIABLE} must name an open socket's file descriptor, got {raw!r}")
    try:
        install(adopted_socket(int(raw)))
    except ValueError as err:
        sys.exit(str(err))
    from vllm.entrypoints.launchers.api_server.entry import main as api_server_main

    api_server_main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
