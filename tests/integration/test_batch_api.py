"""The Batch API through a real gateway process, a real router and simulated engines, with the
official openai client: upload, run, cancel, expire, retry, tenancy, a SIGKILL mid-batch of
the runner process and of the gateway, and a gateway handing its batch to a runner process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq

from hpcserve.config import dump_config, hash_api_key, load_config, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.contracts.router_client import list_models, list_replicas
from hpcserve.contracts.usage import read_records
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.services import metrics_headers

KEY_A = "sk-batch-tenant-a"
KEY_B = "sk-batch-tenant-b"
ADMIN = "sk-batch-admin"


def start_engine(
    router: RouterServer, *, decode_ms: float = 1.0, role: str = "interactive"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "sim",
         "--model-path", "/nonexistent", "--served-model-name", "sim", "--pool", "simpool",
         "--role", role, "--router", router.config.registry_bind, "--bind-host", "127.0.0.1",
         "--advertise-host", "127.0.0.1", "--heartbeat-s", "0.25", "--drain-s", "5",
         "--", "--decode-ms-per-token", str(decode_ms)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


class Engines:
    def __init__(self, router: RouterServer) -> None:
        self.router = router
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, count: int = 1, *, decode_ms: float = 1.0, role: str = "interactive") -> None:
        before = len(list_replicas(self.router.config.routing_bind))
        self.procs += [
            start_engine(self.router, decode_ms=decode_ms, role=role) for _ in range(count)
        ]
        wait_for(
            f"{count} engine(s) to register",
            lambda: len(list_replicas(self.router.config.routing_bind)) >= before + count,
            timeout=30,
        )


@pytest.fixture
def engines(router: RouterServer) -> Iterator[Engines]:
    started = Engines(router)
    try:
        yield started
    finally:
        for proc in started.procs:
            stop(proc)


class ServiceProcess:
    """An `hpcserve` service this test starts, stops and kills."""

    proc: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


class GatewayProcess(ServiceProcess):
    """`hpcserve gateway --config` on a config of this test's; restartable on one state dir."""

    def __init__(self, router: RouterServer, state_dir: Path, batch: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.router, self.state_dir = router, state_dir
        self.config_path = state_dir / "gateway.toml"
        self.write_config({"metrics_port": free_port(), **batch})  # `hpcserve batch-runner`'s
        self.log_path = state_dir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def metrics_headers(self) -> dict[str, str]:
        return metrics_headers(self.config_path)

    def write_config(self, batch: dict[str, Any]) -> None:
        """The config file (read by processes started after this)."""
        router, state_dir = self.router, self.state_dir
        self.batch = batch
        config = parse_config({
            "state_dir": str(state_dir),
            "router": {"registry_bind": router.config.registry_bind,
                       "routing_bind": router.config.routing_bind,
                       "lease_s": router.config.lease_s, "heartbeat_s": router.config.heartbeat_s,
                       "allow_plain_loopback": True},
            "gateway": {"port": self.port,
                        "api_keys": [{"tenant": "a", "sha256": hash_api_key(KEY_A)},
                                     {"tenant": "b", "sha256": hash_api_key(KEY_B)}],
                        "admin_keys": [hash_api_key(ADMIN)]},
            "pools": [{"name": "sim", "model_path": "/nonexistent", "engine": "sim"}],
            "batch": batch,
        })  # fmt: skip
        self.config_path.write_text(dump_config(config))

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hpcserve.cli",
                    "gateway",
                    "--config",
                    str(self.config_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.url + "/health", timeout=1)
                return
            except httpx.TransportError:
                assert self.proc.poll() is None, self.log_path.read_text()
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.1)

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)


class RunnerProcess(ServiceProcess):
    """`hpcserve batch-runner` on a gateway's config (same store, same router)."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.config_path = gateway.config_path
        self.metrics_url = f"http://127.0.0.1:{parse_metrics_port(gateway.config_path)}/metrics"
        self.log_path = gateway.config_path.parent / "batch-runner.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hpcserve.cli", "batch-runner", "--config",
                 str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        proc = self.proc

        def up() -> bool:
            assert proc.poll() is None, self.log_path.read_text()
            try:
                reply = httpx.get(self.metrics_url, timeout=1, headers=self.metrics_headers())
            except httpx.TransportError:
                return False
            return reply.status_code == 200

        wait_for("the batch runner process to serve /metrics", up, timeout=30)

    def metrics_headers(self) -> dict[str, str]:
        return metrics_headers(self.config_path)


def parse_metrics_port(config_path: Path) -> int:
    return load_config(config_path).batch.metrics_port


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """A metric without labels from a /metrics page (-1 when absent)."""
    for line in httpx.get(url, headers=headers, timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return -1.0


@pytest.fixture
def make_runner() -> Iterator[Callable[[GatewayProcess], RunnerProcess]]:
    made: list[RunnerProcess] = []

    def make(gateway: GatewayProcess) -> RunnerProcess:
        runner = RunnerProcess(gateway)
        made.append(runner)
        runner.start()
        return runner

    try:
        yield make
    finally:
        for runner in made:
            runner.stop()


@pytest.fixture
def make_gateway(router: RouterServer, tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    made: list[GatewayProcess] = []

    def make(**batch: Any) -> GatewayProcess:
        gateway = GatewayProcess(router, tmp_path, batch)
        made.append(gateway)
        gateway.start()
        return gateway

    try:
        yield make
    finally:
        for gateway in made:
            gateway.stop()


def jsonl(requests: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in requests)


def chat_lines(count: int, *, max_tokens: int = 4, model: str = "sim") -> bytes:
    return jsonl([
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "max_tokens": max_tokens,
                  "messages": [{"role": "user", "content": f"extract document {i}"}]}}
        for i in range(count)
    ])  # fmt: skip


def submit(client: openai.OpenAI, data: bytes) -> Any:
    upload = client.files.create(file=("input.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait_status(
    client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 60
) -> Any:
    return wait_for(
        f"batch {batch_id} to reach {statuses}",
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        timeout=timeout,
    )


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def engine_requests(router: RouterServer, max_tokens: int) -> int:
    """Requests of `max_tokens` tokens the engines finished. The engines also answer the
    health monitor's one-token probes: with S requests and G tokens in all, the test's are
    (G - S) / (max_tokens - 1)."""
    requests = tokens = 0.0
    for replica in list_replicas(router.config.routing_bind):
        for line in httpx.get(replica.url + "/metrics", timeout=5).text.splitlines():
            value = float(line.rsplit(" ", 1)[1]) if not line.startswith("#") else 0.0
            if line.startswith("vllm:request_success_total"):
                requests += value
            elif line.startswith("vllm:generation_tokens_total"):
                tokens += value
    count, rest = divmod(tokens - requests, max_tokens - 1)
    assert rest == 0, (tokens, requests)
    return int(count)


def test_the_openai_client_runs_a_batch_end_to_end(
    engines: Engines, make_gateway: Callable[..., GatewayProcess]
) -> None:
    engines.start(2)
    gateway = make_gateway()
    client = gateway.client()
    upload = client.files.create(file=("extract.jsonl", chat_lines(30)), purpose="batch")
    assert (upload.object, upload.purpose, upload.filename) == ("file", "batch", "extract.jsonl")
    assert upload.bytes == len(chat_lines(30))
    assert client.files.retrieve(upload.id).id == upload.id
    assert client.files.content(upload.id).content == chat_lines(30)
    created = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"family": "bill-of-lading"},
    )
    assert created.status == "validating"
    assert created.expires_at == created.created_at + 86_400
    done = wait_status(client, created.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (30, 30)
    assert done.request_counts.failed == 0
    assert done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.metadata == {"family": "bill-of-lading"}
    assert done.model == "sim"
    assert done.usage is not None and done.usage.output_tokens == 30 * 4
    output = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(30))
    for line in output:
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        assert line["response"]["request_id"].startswith("req_")
        assert line["response"]["body"]["object"] == "chat.completion"
    out_file = client.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output"
    # A second batch; listing pages through both, newest first.
    second = submit(client, chat_lines(3))
    wait_status(client, second.id, {"completed"})
    first_page = client.batches.list(limit=1)
    assert [b.id for b in first_page.data] == [second.id]
    assert first_page.has_more
    assert [b.id for b in client.batches.list(limit=1, after=second.id).data] == [created.id]
    assert [b.id for b in client.batches.list(limit=1)] == [second.id, created.id]
    # Each line's usage record, for `hpcserve report` (contracts/usage.py).
    records = list(read_records(gateway.state_dir / "usage", 0, 4e9))
    assert {(r.source, r.tenant, r.model) for r in records} == {("batch", "a", "sim")}
    assert len(records) == 33 and sum(r.completion_tokens for r in records) == 33 * 4
    assert all(r.replica and r.status == 200 for r in records)
    assert {f.id for f in client.files.list(purpose="batch")} >= {upload.id}
    # An input file that a finished batch used can be deleted.
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_a_batch_runs_on_the_batch_pool_and_interactive_requests_stay_off_it(
    engines: Engines, make_gateway: Callable[..., GatewayProcess], router: RouterServer
) -> None:
    engines.start(role="batch")
    engines.start(role="interactive")
    roles = {r.role: r.url for r in list_replicas(router.config.routing_bind)}
    assert set(roles) == {"batch", "interactive"}
    gateway = make_gateway()
    client = gateway.client()
    batch = submit(client, chat_lines(30, max_tokens=4))
    for i in range(5):
        answer = client.chat.completions.create(
            model="sim", max_tokens=6, messages=[{"role": "user", "content": f"status {i}"}]
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 6
    done = wait_status(client, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == 30

    def served(url: str) -> dict[str, float]:
        counts = {"vllm:request_success_total": 0.0, "vllm:generation_tokens_total": 0.0}
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in counts:
                counts[name] += float(line.rsplit(" ", 1)[1])
        return counts

    # Every batch line (4 tokens) on the batch pool, every chat (6 tokens) on the other;
    # besides them only the health monitor's one-token probes.
    batch_pool, interactive = served(roles["batch"]), served(roles["interactive"])
    assert (
        batch_pool["vllm:generation_tokens_total"] - batch_pool["vllm:request_success_total"]
        == 30 * 3
    )
    assert (
        interactive["vllm:generation_tokens_total"] - interactive["vllm:request_success_total"]
        == 5 * 5
    )


def test_a_bad_file_is_a_400_naming_every_bad_line(
    engines: Engines, make_gateway: Callable[..., GatewayProcess]
) -> None:
    gateway = make_gateway(max_lines=5)
    client = gateway.client()
    good = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": []}}  # fmt: skip
    data = jsonl([good, {**good, "method": "GET", "custom_id": "y"}, good]) + b"{not json\n"
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", data), purpose="batch")
    message = caught.value.message
    assert "line 2: 'method' must be 'POST'" in message
    assert "line 3: 'custom_id' 'x' is already used by line 1" in message
    assert "line 4: not a JSON object" in message
    with pytest.raises(openai.BadRequestError, match="more than 5 lines"):
        client.files.create(file=("long.jsonl", chat_lines(6)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="'purpose' must be 'batch'"):
        client.files.create(file=("x.jsonl", chat_lines(1)), purpose="fine-tune")
    assert client.files.list().data == [], "nothing was stored"
    upload = client.files.create(file=("ok.jsonl", chat_lines(1)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    # A file whose lines call another endpoint than the batch's: the batch fails, naming them.
    failed = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    failed = wait_status(client, failed.id, {"failed"})
    assert failed.failed_at and failed.errors and failed.errors.data
    assert failed.errors.data[0].line == 1
    assert failed.errors.data[0].code == "invalid_url"


def test_tenants_see_only_their_own_files_and_batches(
    engines: Engines, make_gateway: Callable[..., GatewayProcess]
) -> None:
    engines.start()
    gateway = make_gateway()
    a, b, admin = gateway.client(KEY_A), gateway.client(KEY_B), gateway.client(ADMIN)
    batch = submit(a, chat_lines(2))
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        b.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert b.batches.list().data == [] and b.files.list().data == []
    assert [x.id for x in admin.batches.list().data] == [batch.id]
    done = wait_status(admin, batch.id, {"completed"})
    assert len(lines_of(admin, done.output_file_id)) == 2
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    assert admin.files.retrieve(done.output_file_id).purpose == "batch_output"
    with pytest.raises(openai.AuthenticationError):
        gateway.client("sk-nobody").batches.list()


def test_cancel_lets_requests_in_flight_finish_and_ends_cancelled(
    engines: Engines, make_gateway: Callable[..., GatewayProcess], router: RouterServer
) -> None:
    engines.start(decode_ms=10)  # 50 tokens: ~0.5 s a request
    gateway = make_gateway(concurrency_per_replica=2, adaptive_concurrency=False)
    client = gateway.client()
    batch = submit(client, chat_lines(40, max_tokens=50))
    wait_for("two results", lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    ended = wait_status(client, batch.id, {"cancelled"})
    assert ended.cancelled_at and ended.request_counts.completed < 40
    output = lines_of(client, ended.output_file_id)
    errors = lines_of(client, ended.error_file_id)
    assert len(output) == ended.request_counts.completed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(40)), "each line exactly once"
    # What was in flight at the cancel finished (the engine ran no more than was answered).
    assert engine_requests(router, max_tokens=50) == len(output)
    finished = submit_and_finish(client)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(finished.id)


def submit_and_finish(client: openai.OpenAI) -> Any:
    batch = submit(client, chat_lines(1, max_tokens=1))
    return wait_status(client, batch.id, {"completed"})


def test_a_batch_past_its_window_expires_with_what_completed(
    engines: Engines, make_gateway: Callable[..., GatewayProcess]
) -> None:
    engines.start(decode_ms=10)
    # The window must leave time for a first answer on a loaded machine (the batch starts
    # after validation), and the work must outlast it however fast the machine: the
    # simulated engine's decode is wall time, 80 x 50 tokens x 10 ms at 2 = 20 s at best.
    gateway = make_gateway(
        concurrency_per_replica=2, adaptive_concurrency=False, completion_window_s=6
    )
    client = gateway.client()
    batch = submit(client, chat_lines(80, max_tokens=50))
    assert batch.expires_at - batch.created_at == 6
    ended = wait_status(client, batch.id, {"expired"}, timeout=60)
    assert ended.expired_at and 0 < ended.request_counts.completed < 80
    output = lines_of(client, ended.output_file_id)
    errors = lines_of(client, ended.error_file_id)
    assert len(output) == ended.request_counts.completed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sorted(x["custom_id"] for x in output + errors) == sorted(f"req-{i}" for i in range(80))


class DeadReplica:
    """A replica registered with the real router whose URL refuses connections, kept alive
    with heartbeats: what the router believes of an engine that just died."""

    def __init__(self, router: RouterServer) -> None:
        self._stop = threading.Event()
        dead_port = free_port()  # nothing listens there
        self._thread = threading.Thread(
            target=self._run,
            args=(router.config.registry_bind, f"http://127.0.0.1:{dead_port}"),
            daemon=True,
        )
        self._thread.start()

    def _run(self, endpoint: str, url: str) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            sock.send(p.encode(p.Register("dead-replica", "sim", url, pool="simpool")))
            while not self._stop.wait(0.2):
                sock.send(p.encode(p.Heartbeat("dead-replica")))
                while sock.poll(0):
                    sock.recv()
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_replica_failures_are_retried_elsewhere_then_recorded_in_the_error_file(
    engines: Engines, make_gateway: Callable[..., GatewayProcess], router: RouterServer
) -> None:
    dead = DeadReplica(router)
    try:
        wait_for("the dead replica to register", lambda: list_models(router.config.routing_bind))
        gateway = make_gateway(max_attempts=2, retry_backoff_s=0.05)
        client = gateway.client()
        # Only the dead replica: every request fails twice, then goes to the error file.
        failed = wait_status(client, submit(client, chat_lines(5)).id, {"completed"})
        assert failed.request_counts.failed == 5 and failed.output_file_id is None
        errors = lines_of(client, failed.error_file_id)
        assert {e["error"]["code"] for e in errors} == {"replica_failed"}
        assert all("failed 2 times" in e["error"]["message"] for e in errors)
        # With a live engine beside it, requests the dead one failed are retried there.
        engines.start()
        done = wait_status(client, submit(client, chat_lines(40)).id, {"completed"})
        assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
        metrics = httpx.get(gateway.url + "/metrics", headers=gateway.metrics_headers()).text
        retries = [m for m in metrics.splitlines() if m.startswith("hpcserve_batch_retries_total")]
        assert retries and float(retries[0].split()[-1]) > 0
    finally:
        dead.close()


def test_a_runner_process_killed_mid_batch_resumes_without_losing_or_repeating_results(
    engines: Engines,
    make_gateway: Callable[..., GatewayProcess],
    make_runner: Callable[[GatewayProcess], RunnerProcess],
    router: RouterServer,
) -> None:
    engines.start(decode_ms=10)
    # One request at a time (~0.2 s each) until the kill: the batch is far from done then,
    # however late this test gets to run again.
    gateway = make_gateway(runner="process", concurrency_per_replica=1, adaptive_concurrency=False)
    runner = make_runner(gateway)
    client = gateway.client()
    batch = submit(client, chat_lines(60, max_tokens=20))
    wait_for(
        "some results", lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5
    )
    runner.kill()
    assert runner.proc is not None and runner.proc.returncode == -signal.SIGKILL
    stored = client.batches.retrieve(batch.id).request_counts.completed
    # The gateway too: it serves the API only, and comes back on the same store.
    gateway.kill()
    gateway.start()
    # With no runner, the gateway (batch.runner = "process") runs nothing and says so.
    wait_for(
        "the gateway to report the batch waiting with no runner",
        lambda: metric(gateway.url + "/metrics", "hpcserve_batch_waiting_without_runner", gateway.metrics_headers()) == 1,
    )
    assert client.batches.retrieve(batch.id).request_counts.completed == stored
    assert "no process holds" in gateway.log_path.read_text()
    gateway.write_config({**gateway.batch, "concurrency_per_replica": 16})  # the rest: faster
    runner.start()  # same store
    done = wait_status(client, batch.id, {"completed"}, timeout=60)
    assert (done.request_counts.completed, done.request_counts.failed) == (60, 0)
    output = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(60))
    # Only what was in flight (sent, or answered and not yet stored) at the kill ran twice.
    assert 60 <= engine_requests(router, max_tokens=20) <= 60 + 1
    assert metric(runner.metrics_url, "hpcserve_batch_runner_lock_held", runner.metrics_headers()) == 1
    assert metric(gateway.url + "/metrics", "hpcserve_batch_runner_lock_held", gateway.metrics_headers()) == 0
    # `hpcserve batches` reads the same store.
    listing = subprocess.run(
        [sys.executable, "-m", "hpcserve.cli", "batches", "--config", str(gateway.config_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert listing[0].split()[:6] == ["BATCH", "TENANT", "STATUS", "DONE", "FAILED", "TOTAL"]
    assert listing[1].split()[:6] == [batch.id, "a", "completed", "60", "0", "60"]
    assert listing[-1].startswith("runner: batch-runner pid ")


def test_a_standby_gateway_hands_its_batch_to_a_runner_process_without_redoing_a_request(
    engines: Engines,
    make_gateway: Callable[..., GatewayProcess],
    make_runner: Callable[[GatewayProcess], RunnerProcess],
    router: RouterServer,
) -> None:
    engines.start(decode_ms=10)  # 50 tokens: ~0.5 s a request
    gateway = make_gateway(concurrency_per_replica=4, adaptive_concurrency=False)  # "standby"
    client = gateway.client()
    batch = submit(client, chat_lines(400, max_tokens=50))  # ~50 s: cancelled below
    wait_for(
        "the gateway's results",
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4,
    )
    assert metric(gateway.url + "/metrics", "hpcserve_batch_runner_lock_held", gateway.metrics_headers()) == 1
    runner = make_runner(gateway)
    wait_for(
        "the runner process to take the lock",
        lambda: metric(runner.metrics_url, "hpcserve_batch_runner_lock_held", runner.metrics_headers()) == 1,
        timeout=60,
    )
    assert metric(gateway.url + "/metrics", "hpcserve_batch_runner_lock_held", gateway.metrics_headers()) == 0
    handed = client.batches.retrieve(batch.id).request_counts.completed
    wait_for(
        "the runner process's results",
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= handed + 4,
    )
    client.batches.cancel(batch.id)
    ended = wait_status(client, batch.id, {"cancelled"})
    output = lines_of(client, ended.output_file_id)
    errors = lines_of(client, ended.error_file_id)
    assert len(output) == ended.request_counts.completed
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(400)), "each line exactly once"
    # The gateway's requests in flight at the hand-over finished and were stored by it:
    # the engines ran each answered line once.
    assert engine_requests(router, max_tokens=50) == len(output)
    log = gateway.log_path.read_text()
    assert "handing 1 batch(es) over" in log and "released" in log
