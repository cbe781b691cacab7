"""gateway/workers.py's parts: sockets sharing a port, one exposition from several, the
config keys."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hpcserve.config import ConfigError, parse_config
from hpcserve.gateway.workers import (
    WorkerSet,
    merge_expositions,
    reuseport_socket,
    run_workers,
    worker_address,
)


def test_workers_share_a_port_that_a_plain_listener_would_refuse() -> None:
    first = reuseport_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = reuseport_socket("127.0.0.1", port)  # a second worker on the same port
    try:
        assert second.getsockname()[1] == port
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    finally:
        first.close()
        second.close()


def test_a_port_taken_by_another_program_is_refused_before_any_worker_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run_workers(2, "127.0.0.1", port, print, ()) == 2


EXPOSITION = """# HELP hits_total Hits
# TYPE hits_total counter
hits_total{model="m"} %d.0
# HELP wait_seconds Waits
# TYPE wait_seconds histogram
wait_seconds_bucket{le="1.0"} 1.0
wait_seconds_bucket{le="+Inf"} 1.0
wait_seconds_count 1.0
wait_seconds_sum 0.5
"""


def test_one_exposition_labels_every_workers_series() -> None:
    text = merge_expositions([("0", EXPOSITION % 3), ("1", EXPOSITION % 5)]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    hits = {s.labels["worker"]: s.value for s in families["hits"].samples}
    assert hits == {"0": 3.0, "1": 5.0}
    counts = [s for s in families["wait_seconds"].samples if s.name == "wait_seconds_count"]
    assert sorted(s.labels["worker"] for s in counts) == ["0", "1"]
    assert text.count("# TYPE hits_total counter") == 1


@pytest.mark.parametrize(
    ("key", "value"), [("workers", 0), ("workers", 10_000), ("prompt_cache_mb", -1)]
)
def test_bad_values_are_refused_naming_the_key(key: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"gateway.{key}"):
        parse_config({"gateway": {key: value}})


def test_the_metrics_token_goes_to_no_socket_another_user_holds(tmp_path: Path) -> None:
    """Abstract sockets have no permissions: a user who binds worker 1's name first gets
    no scrape (and so no metrics token); worker 0's own series are still served."""
    assert os.geteuid() == 0, "the suite runs as root (it starts another user's process)"
    squatted = worker_address(str(tmp_path), "127.0.0.1", 8000, 1)
    script = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind({squatted!r}); s.listen(1); print('ready', flush=True)\n"
        "c, _ = s.accept(); c.settimeout(3)\n"
        "try:\n    print(repr(c.recv(4096)), flush=True)\n"
        "except OSError:\n    print('nothing', flush=True)\n"
    )
    # Debian's python: the suite's own lives under /root, which nobody may enter.
    child = subprocess.Popen(
        ["/usr/bin/python3", "-c", script], user="nobody", stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        registry = CollectorRegistry()
        Counter("seen", "a series of worker 0", registry=registry).inc()
        workers = WorkerSet(0, [worker_address(str(tmp_path), "127.0.0.1", 8000, 0), squatted])
        merged = asyncio.run(workers.merged(generate_latest(registry), "Bearer the-token"))
        said, _ = child.communicate(timeout=10)
    finally:
        child.kill()
    assert "the-token" not in said
    assert 'seen_total{worker="0"} 1.0' in merged.decode()
