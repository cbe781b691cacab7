"""bench/simfleet.py's start checks: a stack is ready only when its own processes serve it.

A port squatted by another server once answered the gateway's health check (the fleet had
bound the gateway's port), and a whole benchmark cell went to one replica directly.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.simfleet import _check_running, _wait_gateway


class _AnyPath200(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"vllm:num_requests_running 0\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def squatter() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnyPath200)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    yield proc
    proc.kill()
    proc.wait()


def test_another_server_on_the_gateway_port_is_not_the_gateway(
    squatter: int, sleeper: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    token = tmp_path / "metrics-token"
    token.write_text("t\n")
    with pytest.raises(TimeoutError, match=r"gateway .* not up"):
        _wait_gateway(f"http://127.0.0.1:{squatter}", {"gateway": sleeper}, tmp_path, token, 0.5)


def test_a_service_that_exited_is_named_with_its_last_log_lines(tmp_path: Path) -> None:
    (tmp_path / "gateway.log").write_text("starting\nERROR [Errno 98] address already in use\n")
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match=r"the gateway exited \(3\).*address already in use"):
        _check_running({"gateway": dead}, tmp_path)
