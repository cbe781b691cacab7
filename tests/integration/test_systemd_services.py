"""Issue 24, "how to show it": the stack as systemd would run it, on the test Slurm cluster.

systemd is not PID 1 here, so the units are checked with `systemd-analyze verify` (tests/
unit/test_systemd_units.py) and their ExecStart lines are run as systemd would: parsed from
the units `hpcserve install-units` wrote, with their Environment=, User=, UMask= and "/" as
working directory, as a non-root service account, from a venv it may run (the suite's own
sits under /root). Two gateway instances (hpcserve-gateway@PORT) behind a small load
balancer, the router, the pool manager (whose Slurm jobs run the simulated engine as the
service account) and the batch runner. Under client traffic through the official openai
client (no retries), each service is restarted in turn: no request fails. Gateways are
restarted one at a time, each taken out of the balancer first and put back once it answers
(docs/deploy.md, Upgrade). Then everything stops cleanly: exit status 0, no process of
the service account left, and it wrote nothing outside the paths its units allow.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from hpcserve.config import PlatformConfig, dump_config, hash_api_key, parse_config
from hpcserve.contracts.router_client import RouterQueryError, list_replicas
from hpcserve.localslurm import LocalSlurm
from hpcserve.poolmgr.identity import parse_comment
from hpcserve.poolmgr.single import EXIT_HELD, holder_pid
from hpcserve.slurm.client import SlurmCLI
from tests.integration.slurm_helpers import running_cluster, wait_for
from tests.ports import free_port
from tests.systemd_units import ServiceCommand, service_command

pytestmark = pytest.mark.slurm

ACCOUNT = "hpcserve-svc"
KEY = "sk-systemd-services-3f9a"
PREFIX = "hs-svc"
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What systemd counts as a clean stop of a service's main process: exit 0, or death by
# SIGHUP, SIGINT, SIGTERM or SIGPIPE (uvicorn re-raises the SIGTERM it handled).
CLEAN = {0, -signal.SIGHUP, -signal.SIGINT, -signal.SIGTERM, -signal.SIGPIPE}


def service_account() -> pwd.struct_passwd:
    """The unprivileged service account, created if absent (as a site's admin would)."""
    if os.geteuid() != 0:
        pytest.fail("starting services as a service account needs root (the suite runs as root)")
    try:
        return pwd.getpwnam(ACCOUNT)
    except KeyError:
        subprocess.run(
            [
                "useradd", "--system", "--user-group", "--no-create-home",
                "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", ACCOUNT,
            ],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        entry = pwd.getpwnam(ACCOUNT)
        assert entry.pw_uid != 0 and entry.pw_gid != 0
        return entry


def make_venv(where: Path) -> Path:
    """A venv the service account may run: Debian's python3.11 with this checkout's packages
    (the suite's venv has its interpreter under /root, which only root may enter)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    python = shutil.which(version, path="/usr/bin:/usr/local/bin")
    assert python, f"no {version} outside /root (Debian: apt-get install {version})"
    subprocess.run([python, "-m", "venv", "--without-pip", str(where)], check=True)
    packages = [p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages")]
    site_dir = where / "lib" / version / "site-packages"
    (site_dir / "hpcserve-checkout.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in packages)
    )
    script = where / "bin" / "hpcserve"
    script.write_text(
        f"#!{where}/bin/python\nimport sys\nfrom hpcserve.cli import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return where


class Balancer:
    """A TCP load balancer on loopback: each new connection goes to the next gateway in
    rotation (the next one if a connect fails); `take_out` stops new connections to one,
    `active` counts the connections still open to each."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.in_rotation = set(ports)
        self.active = dict.fromkeys(ports, 0)
        self.served = dict.fromkeys(ports, 0)
        self._next = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="balancer", daemon=True).start()

    def take_out(self, port: int) -> None:
        with self._lock:
            self.in_rotation.discard(port)

    def put_back(self, port: int) -> None:
        with self._lock:
            self.in_rotation.add(port)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _choose(self) -> list[int]:
        with self._lock:
            order = [p for p in self.ports[self._next :] + self.ports[: self._next]]
            self._next = (self._next + 1) % len(self.ports)
            return [p for p in order if p in self.in_rotation]

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        for port in self._choose():
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue
            upstream.settimeout(None)
            with self._lock:
                self.active[port] += 1
                self.served[port] += 1
            pumps = [
                threading.Thread(target=_pump, args=(client, upstream), daemon=True),
                threading.Thread(target=_pump, args=(upstream, client), daemon=True),
            ]
            for pump in pumps:
                pump.start()
            for pump in pumps:
                pump.join()
            upstream.close()
            client.close()
            with self._lock:
                self.active[port] -= 1
            return
        client.close()  # no gateway in rotation answers: the client sees the failure


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@dataclass
class Service:
    unit: str
    instance: str
    command: ServiceCommand
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    exits: list[int] = field(default_factory=list)


class Services:
    """Starts and stops units' ExecStart lines as systemd would (User=, Environment=,
    UMask=, working directory "/"; stop: SIGTERM, to the main process for KillMode=mixed,
    else to the unit's processes, then waiting TimeoutStopSec)."""

    def __init__(self, units: Path, logs: Path, account: pwd.struct_passwd) -> None:
        self.units = units
        self.logs = logs
        self.account = account
        self.running: dict[str, Service] = {}

    def start(self, unit: str, instance: str = "") -> Service:
        name = unit.replace("@.", f"@{instance}.")
        command = service_command(self.units / unit, instance)
        assert command.user == self.account.pw_name
        log = self.logs / f"{name}.log"
        service = self.running.get(name) or Service(unit, instance, command, log)
        with open(log, "ab") as out:
            service.proc = subprocess.Popen(
                command.argv,
                env={"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", **command.env},
                cwd="/",
                user=self.account.pw_uid,
                group=self.account.pw_gid,
                extra_groups=[],
                umask=int(command.one("UMask"), 8),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.running[name] = service
        return service

    def stop(self, name: str) -> int:
        service = self.running[name]
        assert service.proc is not None
        kill_mode = service.command.unit["Service"].get("KillMode", ["control-group"])[0]
        if kill_mode == "mixed":
            service.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(service.proc.pid, signal.SIGTERM)
        timeout = float(service.command.one("TimeoutStopSec"))
        try:
            status = service.proc.wait(timeout + 30)  # a loaded 2-core machine stretches it
        except subprocess.TimeoutExpired:
            os.killpg(service.proc.pid, signal.SIGKILL)
            service.proc.wait()
            raise AssertionError(f"{name} did not stop on SIGTERM: {self.tail(name)}") from None
        service.exits.append(status)
        service.proc = None
        return status

    def restart(self, name: str) -> int:
        service = self.running[name]
        status = self.stop(name)
        self.start(service.unit, service.instance)
        return status

    def tail(self, name: str, lines: int = 30) -> str:
        text = self.running[name].log.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def kill_all(self) -> None:
        for service in self.running.values():
            if service.proc is not None and service.proc.poll() is None:
                os.killpg(service.proc.pid, signal.SIGKILL)
                service.proc.wait()


class Traffic:
    """Chat requests, plain and streamed, one after another through the balancer with the
    official openai client (no retries, a new connection per request, as a per-request
    balancer sees them); every failure is kept."""

    def __init__(self, port: int) -> None:
        self.http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=60)
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key=KEY,
            max_retries=0,
            http_client=self.http,
        )
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def one(self, i: int) -> str:
        messages = [{"role": "user", "content": f"request {i} a b c"}]
        if i % 2:
            chunks = self.client.chat.completions.create(
                model="sim",
                messages=messages,
                max_tokens=4,
                stream=True,  # type: ignore[arg-type]
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reply = self.client.chat.completions.create(
            model="sim",
            messages=messages,
            max_tokens=4,  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content or ""

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                text = self.one(i)
                assert text == " tok0 tok1 tok2 tok3", text
                self.ok += 1
            except Exception as err:  # every failure counts, whatever its kind
                self.failures.append(f"request {i}: {type(err).__name__}: {err}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        self.http.close()

    def wait_for_more(self, what: str, count: int = 10) -> None:
        target = self.ok + count
        wait_for(f"{count} more requests {what}", lambda: self.ok >= target or self.failures)


@dataclass
class Stack:
    base: Path
    config: PlatformConfig
    services: Services
    slurm: SlurmCLI
    gateway_ports: list[int]
    balancer: Balancer
    account: pwd.struct_passwd


def _as_account(account: pwd.struct_passwd, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env={"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8"},
        cwd="/",
        user=account.pw_uid,
        group=account.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalSlurm]:
    """The two-node cluster, in a directory every user may pass through: slurmd runs a job
    script from its spool there as the job's user (here the service account; pytest's own
    temporary directories are root's alone)."""
    where = Path(tempfile.mkdtemp(prefix="hpcserve-slurm-"))
    where.chmod(0o755)
    try:
        yield from running_cluster(where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(cluster: LocalSlurm) -> Iterator[Stack]:
    account = service_account()
    base = Path(tempfile.mkdtemp(prefix="hpcserve-systemd-"))
    base.chmod(0o755)  # the service account passes through; its state dir is its own
    services: Services | None = None
    slurm = SlurmCLI(cluster.env(), timeout_s=10)
    try:
        venv = make_venv(base / "venv")
        state = base / "state"
        state.mkdir(mode=0o700)
        os.chown(state, account.pw_uid, account.pw_gid)
        # The cluster's slurm.conf where every user reads it (a site's is in /etc/slurm).
        slurm_conf = base / "slurm.conf"
        shutil.copy(cluster.conf_path, slurm_conf)
        slurm_conf.chmod(0o644)
        gateway_ports = [free_port(), free_port()]
        config = parse_config(
            {
                "state_dir": str(state),
                "router": {
                    "registry_bind": f"tcp://127.0.0.1:{free_port()}",
                    "routing_bind": f"tcp://127.0.0.1:{free_port()}",
                    "curve_dir": str(state / "curve"),
                    "heartbeat_s": 0.5,
                    "lease_s": 5.0,
                    "metrics_port": free_port(),
                },
                "gateway": {
                    "host": "127.0.0.1",
                    "port": gateway_ports[0],
                    "api_keys": [{"tenant": "t", "sha256": hash_api_key(KEY)}],
                },
                "slurm": {
                    "conf": str(slurm_conf),
                    "partition": "gpu",
                    "time_limit_min": 30,
                    "drain_s": 10,
                },
                "poolmgr": {
                    "poll_s": 1.0,
                    "min_submit_interval_s": 0.5,
                    "job_name_prefix": PREFIX,
                    "handover_lead_s": 0,
                    "metrics_port": free_port(),
                },
                "batch": {"metrics_port": free_port()},
                "engine": {"bind_host": "127.0.0.1", "advertise_host": "127.0.0.1"},
                "pools": [
                    {
                        "name": "sim",
                        "model_path": "/nonexistent",
                        "engine": "sim",
                        "engine_args": ["--decode-ms-per-token", "5"],
                        "replicas": 1,
                    }
                ],
            }
        )
        etc = base / "etc"
        etc.mkdir()
        config_file = etc / "hpcserve.toml"
        config_file.write_text(dump_config(config))  # root's, 0644: no secret in it
        config_file.chmod(0o644)
        units = base / "units"
        out = subprocess.run(
            [
                sys.executable, "-m", "hpcserve.cli", "install-units", "--config",
                str(config_file), "--prefix", str(venv), "--user", ACCOUNT, "--dest", str(units),
                *(f"--gateway-port={port}" for port in gateway_ports),
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        for unit in sorted(units.iterdir()):
            name = unit.name.replace("@.", f"@{gateway_ports[0]}.")
            verify = subprocess.run(
                ["systemd-analyze", "verify", "--man=no", str(units / name)],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert (verify.returncode, verify.stdout + verify.stderr) == (0, ""), name
        # What an admin does once: CURVE keys, as the service account.
        keys = _as_account(
            account, [str(venv / "bin" / "hpcserve"), "keys", "--config", str(config_file)]
        )
        assert keys.returncode == 0, keys.stderr
        logs = base / "logs"
        logs.mkdir()
        services = Services(units, logs, account)
        services.start("hpcserve-router.service")
        for port in gateway_ports:
            services.start("hpcserve-gateway@.service", str(port))
        services.start("hpcserve-poolmgr.service")
        services.start("hpcserve-batch-runner.service")
        balancer = Balancer(gateway_ports)
        stack = Stack(base, config, services, slurm, gateway_ports, balancer, account)
        try:
            wait_for(
                "a replica to register and both gateways to answer",
                lambda: _replicas(config) and all(_gateway_ready(p) for p in gateway_ports),
                timeout=180,
            )
        except AssertionError:
            outputs = sorted((state / "jobs").glob("*.out"), key=lambda p: p.stat().st_mtime)
            raise AssertionError(
                "\n".join(f"--- {n}\n{services.tail(n)}" for n in services.running)
                + "".join(f"\n--- {p}\n{p.read_text()[-3000:]}" for p in outputs[-1:])
            ) from None
        yield stack
        balancer.close()
    finally:
        if services is not None:
            services.kill_all()
        active = [j.job_id for j in slurm.jobs(name_prefix=PREFIX + "-").jobs if j.state.is_active]
        if active:
            slurm.cancel(active)
            wait_for(
                "the jobs to end",
                lambda: (
                    not any(j.state.is_active for j in slurm.jobs(name_prefix=PREFIX + "-").jobs)
                ),
            )
        shutil.rmtree(base, ignore_errors=True)


def _replicas(config: PlatformConfig) -> list[object]:
    try:
        return list(list_replicas(config.router.gateways_dial(), curve_dir=config.router.curve_dir))
    except RouterQueryError:
        return []


def _gateway_ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _our_jobs(stack: Stack) -> list[int]:
    return sorted(
        j.job_id
        for j in stack.slurm.jobs(name_prefix=PREFIX + "-").jobs
        if j.state.is_active and parse_comment(j.comment) is not None
    )


def test_a_request_from_the_openai_client_is_served_by_a_slurm_job_of_the_service_account(
    stack: Stack,
) -> None:
    traffic = Traffic(stack.balancer.port)
    try:
        assert traffic.one(0) == " tok0 tok1 tok2 tok3"
        assert traffic.one(1) == " tok0 tok1 tok2 tok3"  # streamed
    finally:
        traffic.http.close()
    [job] = stack.slurm.jobs(name_prefix=PREFIX + "-").jobs
    shown = subprocess.run(
        ["scontrol", "show", "job", str(job.job_id)],
        env={"PATH": SYSTEMD_PATH, "SLURM_CONF": stack.config.slurm.conf},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"UserId={ACCOUNT}(" in shown
    # Every service runs as the account, none as root.
    for name, service in stack.services.running.items():
        assert service.proc is not None and service.proc.poll() is None, name
        status = Path(f"/proc/{service.proc.pid}/status").read_text()
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        assert set(uids) == {str(stack.account.pw_uid)}, name


def test_a_second_pool_manager_is_refused_naming_the_first(stack: Stack) -> None:
    running = stack.services.running["hpcserve-poolmgr.service"]
    assert running.proc is not None
    assert holder_pid(Path(stack.config.state_dir)) == running.proc.pid
    second = _as_account(stack.account, running.command.argv)
    assert second.returncode == EXIT_HELD, second.stderr
    assert f"(pid {running.proc.pid} on {socket.gethostname()} since " in second.stderr
    # systemd would not restart it either: exit 3 is in RestartPreventExitStatus.
    assert running.command.one("RestartPreventExitStatus") == str(EXIT_HELD)


def test_each_service_restarts_under_traffic_without_a_failed_request(stack: Stack) -> None:
    services = stack.services
    jobs_before = _our_jobs(stack)
    assert len(jobs_before) == 1
    batch_input = stack_batch(stack)
    traffic = Traffic(stack.balancer.port)
    traffic.start()
    try:
        traffic.wait_for_more("before any restart")

        # The router: engines re-register at their next heartbeat; gateways route on their
        # last replica list meanwhile.
        assert services.restart("hpcserve-router.service") in CLEAN
        wait_for("the replica to re-register", lambda: _replicas(stack.config))
        traffic.wait_for_more("after the router's restart")

        # The pool manager: it adopts the running job (no new submission, none cancelled).
        assert services.restart("hpcserve-poolmgr.service") in CLEAN
        new = services.running["hpcserve-poolmgr.service"]
        assert new.proc is not None
        wait_for(
            "the new pool manager to hold the lock",
            lambda: holder_pid(Path(stack.config.state_dir)) == new.proc.pid,  # type: ignore[union-attr]
        )
        wait_for(
            "the new pool manager to report its pools",
            lambda: "pool manager started" in services.tail("hpcserve-poolmgr.service", 5),
        )
        traffic.wait_for_more("after the pool manager's restart")
        assert _our_jobs(stack) == jobs_before
        assert (
            "submitted job"
            not in services.tail("hpcserve-poolmgr.service", 200).split("pool manager started")[-1]
        )

        # The batch runner (the batch created above completes, whoever ran it when).
        assert services.restart("hpcserve-batch-runner.service") in CLEAN
        traffic.wait_for_more("after the batch runner's restart")

        # The gateways, one at a time: out of the balancer, idle, restarted, answering, back.
        for port in stack.gateway_ports:
            rolling_restart(stack, port)
            traffic.wait_for_more(f"after gateway {port}'s restart")
    finally:
        traffic.stop()
    assert traffic.failures == [], traffic.failures[:5]
    assert traffic.ok > 60
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.gateway_ports[0]}/v1", api_key=KEY, max_retries=0
    )
    batch = wait_for(
        "the batch to complete",
        lambda: (b := client.batches.retrieve(batch_input)).status == "completed" and b,
        timeout=120,
    )
    assert batch.output_file_id
    lines = client.files.content(batch.output_file_id).text.splitlines()
    assert len(lines) == 3 and all(
        json.loads(line)["response"]["status_code"] == 200 for line in lines
    )


def rolling_restart(stack: Stack, port: int) -> None:
    """One gateway: out of the balancer, idle, restarted, answering, back in."""
    balancer = stack.balancer
    balancer.take_out(port)
    wait_for(f"gateway {port} to be idle", lambda: balancer.active[port] == 0)
    served = balancer.served[port]
    assert stack.services.restart(f"hpcserve-gateway@{port}.service") in CLEAN
    wait_for(f"gateway {port} to answer", lambda: _gateway_ready(port))
    balancer.put_back(port)
    wait_for(f"gateway {port} to serve again", lambda: balancer.served[port] > served)


def stack_batch(stack: Stack) -> str:
    """A Batch API batch of 3 chat requests, created through a gateway; its id."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.gateway_ports[0]}/v1", api_key=KEY, max_retries=0
    )
    body = "".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "sim",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "x"}],
                },
            }
        )
        + "\n"
        for i in range(3)
    )
    upload = client.files.create(file=("in.jsonl", io.BytesIO(body.encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def test_the_stack_stops_cleanly(stack: Stack) -> None:
    services = stack.services
    # The order `hpcserve down` keeps: nothing resubmits, batches stop, engines drain,
    # then the gateways and the router.
    assert services.stop("hpcserve-poolmgr.service") in CLEAN
    assert services.stop("hpcserve-batch-runner.service") in CLEAN
    jobs = _our_jobs(stack)
    stack.slurm.cancel(jobs, signal="USR1", batch_only=True)  # the drain, as `down` sends it
    wait_for("the engine jobs to drain and end", lambda: not _our_jobs(stack))
    for port in stack.gateway_ports:
        assert services.stop(f"hpcserve-gateway@{port}.service") in CLEAN
    assert services.stop("hpcserve-router.service") in CLEAN
    wait_for(
        "no process of the service account to be left",
        lambda: subprocess.run(["pgrep", "-u", ACCOUNT], capture_output=True).returncode == 1,
    )
    # ReadWritePaths was enough: outside its state dir (and /tmp, where its jobs keep their
    # sockets and PrivateTmp= keeps the services'), the account wrote nothing.
    found = subprocess.run(
        [
            "find", "/", "-xdev", "-path", "/proc", "-prune", "-o", "-path", "/tmp", "-prune",
            "-o", "-path", "/dev", "-prune", "-o", "-path", "/sys", "-prune", "-o",
            "-user", ACCOUNT, "-print",
        ],
        capture_output=True, text=True, timeout=300, check=False,
    ).stdout.split()  # fmt: skip
    assert found == []
    for name, service in services.running.items():
        assert all(status in CLEAN for status in service.exits), (name, service.exits)
