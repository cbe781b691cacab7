"""Usage records (contracts/usage.py, gateway/usage_log.py): one line per served request, in
day files of their own, that survive a killed writer and a restart, read back by period."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.contracts.usage import ReadStats, UsageRecord, read_records, replica_job
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.gateway.usage_log import UsageLog
from hpcserve.router.server import RouterServer

DAY = 86400.0
T0 = 1_780_000_000.0 - 1_780_000_000.0 % DAY  # a UTC midnight


def _record(end: float, tenant: str = "a", prompt: int = 3, completion: int = 5) -> UsageRecord:
    return UsageRecord(
        start=end - 1,
        end=end,
        tenant=tenant,
        model="m",
        prompt_tokens=prompt,
        completion_tokens=completion,
        status=200,
        replica="chat-j16001-0a1b2c",
    )


@pytest.mark.parametrize(
    ("replica", "expected"),
    [
        ("chat-j16001-0a1b2c", ("chat", 16001)),
        ("my-pool-j7-ffffff", ("my-pool", 7)),
        ("pool-j12-j34-abcdef", ("pool-j12", 34)),
        ("chat-host-1234-0a1b2c", None),  # a replica outside Slurm
        ("", None),
    ],
)
def test_replica_ids_name_their_pool_and_job(replica: str, expected: object) -> None:
    assert replica_job(replica) == expected


def test_records_go_to_day_files_and_read_back_by_period(tmp_path: Path) -> None:
    log = UsageLog(tmp_path, "gateway")
    try:
        for end in (T0 + 10, T0 + DAY - 1, T0 + DAY + 5, T0 + 3 * DAY):
            log.write(_record(end))
    finally:
        log.close()
    names = sorted(f.name for f in tmp_path.iterdir())
    assert [n.split(".")[:2] for n in names] == [
        [day, "gateway"] for day in ("2026-05-28", "2026-05-29", "2026-05-31")
    ]
    assert all(os.stat(tmp_path / n).st_mode & 0o777 == 0o600 for n in names)
    stats = ReadStats()
    got = list(read_records(tmp_path, T0, T0 + DAY + 6, stats))
    assert [r.end for r in got] == [T0 + 10, T0 + DAY - 1, T0 + DAY + 5]
    assert stats.files == 2 and stats.records == 3 and stats.bad_lines == 0


def test_a_torn_line_is_skipped_and_counted(tmp_path: Path) -> None:
    log = UsageLog(tmp_path, "batch")
    log.write(_record(T0 + 1))
    log.close()
    (path,) = tmp_path.iterdir()
    with path.open("ab") as f:
        f.write(b'{"start":1,"end":')  # a power loss in the middle of an append
    stats = ReadStats()
    assert [r.end for r in read_records(tmp_path, T0, T0 + DAY, stats)] == [T0 + 1]
    assert stats.bad_lines == 1


_WRITER = """
import os, sys, time
from hpcserve.contracts.usage import UsageRecord
from hpcserve.gateway.usage_log import UsageLog
log = UsageLog(sys.argv[1], "gateway", sync_s=3600)
for i in range(500):
    log.write(UsageRecord(start=time.time(), end=time.time(), tenant="t", model="m",
                          prompt_tokens=i, completion_tokens=1, status=200))
print("written", flush=True)
time.sleep(600)
"""


def test_records_survive_a_killed_writer(tmp_path: Path) -> None:
    """write(2) returned: the line is the kernel's, whatever happens to the process next
    (SIGKILL before any fdatasync, the sync period here is an hour)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "written\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    got = list(read_records(tmp_path, 0, 4e9))
    assert sorted(r.prompt_tokens for r in got) == list(range(500))


KEY = "sk-usage"
ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
    }
).encode()


class _Engine(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url(router: RouterServer) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    router.registry.register(p.Register("chat-j16001-0a1b2c", "m", url), now=1e12)
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def _serve(router: RouterServer, usage_dir: Path, requests: int) -> None:
    config = GatewayConfig(
        api_keys=[ApiKey(tenant="acme", sha256=hash_api_key(KEY))],
        route_timeout_s=60.0,
        audit_log="",
        usage_dir=str(usage_dir),
    )
    gateway = Gateway(config, routing_endpoint=router.config.routing_bind, configured_models={"m"})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(gateway)) as client:
        for _ in range(requests):
            answer = client.post(
                "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-1"},
            )
            assert answer.status_code == 200
        # a refused request is the audit log's, not usage: no replica did any work
        refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 401


def test_the_gateway_writes_one_record_per_answer_across_restarts(
    router: RouterServer, engine_url: str, tmp_path: Path
) -> None:
    _serve(router, tmp_path, 2)
    _serve(router, tmp_path, 1)  # a gateway started again appends to the same day file
    records = list(read_records(tmp_path, 0, 4e9))  # written before the answer returned
    assert len(records) == 3
    for record in records:
        assert (record.tenant, record.model, record.replica) == ("acme", "m", "chat-j16001-0a1b2c")
        assert (record.prompt_tokens, record.completion_tokens, record.status) == (7, 2, 200)
        assert record.key_id == hash_api_key(KEY)[:12] and record.request_id == "req-1"
        assert record.start <= record.end and not record.external
    assert len(list(tmp_path.iterdir())) == 1
