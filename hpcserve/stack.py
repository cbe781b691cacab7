"""`hpcserve up` / `hpcserve down`: the whole stack on one machine, for demos and tests.

`up` writes a demo config into the state dir (unless given one), makes the tiny
demo model, starts a local two-node Slurm cluster (or uses local processes with
`--launcher local`), starts router, gateway, pool manager and batch runner as
background processes with pid files, waits until a replica serves, prints how to use
it and sends one chat request. `down` stops all of it in reverse order: pool manager
first (so nothing is resubmitted), the batch runner (before its engines go: the lines
it has in flight run again at the next start), then the engines (drained), gateway,
router, and the local cluster. Every process it starts is recorded under state_dir/run.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from hpcserve.config import (
    ApiKey,
    EngineHostConfig,
    GatewayConfig,
    PlatformConfig,
    PoolConfig,
    PoolMgrConfig,
    RouterConfig,
    SlurmConfig,
    dump_config,
    hash_api_key,
    load_config,
)
from hpcserve.contracts.engine_token import ensure_token
from hpcserve.contracts.private_files import private_dir, private_opener, write_private
from hpcserve.localslurm import LocalSlurmSpec, pid_alive

SERVICES = ("router", "gateway", "poolmgr", "batch-runner")


def services(config: PlatformConfig) -> tuple[str, ...]:
    """What `up` starts: every service, less the router where the gateway embeds it."""
    return tuple(s for s in SERVICES if s != "router" or not config.gateway.embed_router)


DEMO_MODEL = "tiny-chat"


class StackError(RuntimeError):
    pass


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def has_nvidia_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def say(line: str) -> None:
    print(f"[hpcserve] {line}", flush=True)


def demo_config(state_dir: Path, *, launcher: str, api_key: str) -> PlatformConfig:
    cpu = not has_nvidia_gpu()
    engine_args = ["--max-model-len", "1024"]
    if cpu:
        # The tiny demo model gains nothing from torch.compile, which costs a minute at start.
        engine_args = ["--dtype", "float32", "--enforce-eager", *engine_args]
    return PlatformConfig(
        state_dir=str(state_dir),
        # CURVE on every router socket, loopback included: others may log in to this host.
        router=RouterConfig(curve_dir=str(state_dir / "curve")),
        gateway=GatewayConfig(api_keys=[ApiKey(tenant="demo", sha256=hash_api_key(api_key))]),
        slurm=SlurmConfig(
            partition="gpu",
            time_limit_min=24 * 60,
            drain_s=30,
            conf=str(state_dir / "slurm" / "slurm.conf") if launcher == "slurm" else "",
            log_dir=str(state_dir / "jobs"),
        ),
        poolmgr=PoolMgrConfig(poll_s=2.0, launcher=launcher),  # type: ignore[arg-type]
        engine=EngineHostConfig(
            bind_host="127.0.0.1",
            advertise_host="127.0.0.1",
            cache_dir=str(state_dir / "nodecache"),
        ),
        pools=[
            PoolConfig(
                name=DEMO_MODEL,
                # A registry version, staged into the (demo) node cache by the engine job.
                model_ref=f"{DEMO_MODEL}@1",
                replicas=1,
                gpus_per_replica=1,
                engine="vllm-cpu" if cpu else "vllm",
                engine_args=engine_args,
                env={"VLLM_CPU_KVCACHE_SPACE": "1"} if cpu else {},
                # tools / tool_choice: the demo model's chat template writes Hermes-style
                # <tool_call> blocks (hpcserve/tinymodels.py).
                tool_call_parser="hermes",
            )
        ],
    )


class Stack:
    def __init__(
        self, state_dir: Path, *, config_path: str | None = None, slurm_port: int = 16817
    ) -> None:
        self.state_dir = state_dir.resolve()
        self.slurm_port = slurm_port
        self.run_dir = self.state_dir / "run"
        self.log_dir = self.state_dir / "logs"
        self.config_path = (
            Path(config_path).resolve() if config_path else (self.state_dir / "hpcserve.toml")
        )
        self.key_file = self.state_dir / "demo-api-key"
        # Services outlive `hpcserve up`; a Stack that also stops them reaps them here.
        self._started: dict[str, subprocess.Popen[bytes]] = {}

    # -- up ---------------------------------------------------------------------------------

    def up(self, *, launcher: str | None, timeout_s: float) -> int:
        from hpcserve.localslurm import preflight

        problems = preflight()
        if launcher is None:
            launcher = "slurm" if not problems else "local"
            if problems:
                say("Slurm cannot run a local cluster here:")
                for problem in problems:
                    say(f"  - {problem}")
                say("falling back to --launcher local: engines run as local processes")
        elif launcher == "slurm" and problems:
            for problem in problems:
                say(f"cannot start a local Slurm cluster: {problem}")
            say("run as root with Slurm installed, or use `hpcserve up --launcher local`")
            return 2
        # Owner-only: keys, secrets, batch files, registry, logs (docs/security.md).
        private_dir(self.state_dir)
        config = self._ensure_config(launcher)
        private_dir(config.state_dir)
        ensure_token(config.engine_token_path())
        ensure_token(config.metrics_token_path())
        self._ensure_demo_model(config)
        if config.poolmgr.launcher == "slurm" and config.slurm.conf.startswith(str(self.state_dir)):
            self._start_local_slurm()
        for service in services(config):
            self._start_service(service)
        try:
            self._wait_for_replica(config, timeout_s)
        except StackError as err:
            say(f"not ready: {err}")
            self._print_log_tails()
            say("`hpcserve down` (or `make down`) stops what was started")
            return 1
        self._greet(config)
        return 0

    def _ensure_config(self, launcher: str) -> PlatformConfig:
        if not self.config_path.exists():
            api_key = "sk-hpcserve-demo-" + secrets.token_hex(12)
            write_private(self.key_file, (api_key + "\n").encode())
            config = demo_config(self.state_dir, launcher=launcher, api_key=api_key)
            write_private(self.config_path, dump_config(config).encode())
            say(f"wrote demo config {self.config_path}")
        config = load_config(self.config_path)
        curve = Path(config.router.curve_dir) if config.router.curve_dir else None
        if curve is not None and not all(
            (curve / name).exists() for name in ("router.key_secret", "gateway.key_secret")
        ):
            from hpcserve.contracts.curve import generate_keys

            generate_keys(curve)
            say(f"wrote CURVE keys {curve} (the router's sockets admit only their holders)")
        if config.poolmgr.launcher != launcher and self.config_path.parent == self.state_dir:
            say(f"note: {self.config_path} says launcher={config.poolmgr.launcher}; using it")
        return config

    def _ensure_demo_model(self, config: PlatformConfig) -> None:
        """Make the tiny demo model and register it, for a demo pool that asks for it."""
        demo = [p for p in config.pools if p.name == DEMO_MODEL]
        if not demo:
            return
        pool = demo[0]
        if pool.model_path:
            if not Path(pool.model_path).exists():
                self._make_demo_model(Path(pool.model_path))
            return
        from hpcserve.modelcache.manifest import build_manifest
        from hpcserve.modelcache.registry import NotFoundError, Registry

        Path(config.engine.cache_dir).mkdir(parents=True, exist_ok=True)
        registry = Registry(Path(config.registry_path()))
        try:
            registry.version(pool.model_ref)
        except NotFoundError:
            source = Path(config.state_dir) / "models" / DEMO_MODEL
            if not source.exists():
                self._make_demo_model(source)
            version = registry.add_version(DEMO_MODEL, str(source), build_manifest(source))
            say(f"registered {version.ref} in the model registry {config.registry_path()}")
        finally:
            registry.close()

    def _make_demo_model(self, path: Path) -> None:
        from hpcserve.tinymodels import make_tiny_model

        say(f"making the tiny demo model in {path}")
        make_tiny_model("chat", path, progress=lambda line: say(f"  {line}"))

    def _start_local_slurm(self) -> None:
        from hpcserve.localslurm import LocalSlurm

        cluster = LocalSlurm(self._local_slurm_spec())
        say(f"starting a local two-node Slurm cluster (SLURM_CONF={cluster.conf_path})")
        cluster.start()
        say("Slurm nodes n1, n2 idle, each with 4 (file-backed) GPUs")

    def _local_slurm_spec(self) -> LocalSlurmSpec:
        # One CPU per fake GPU, so four 1-GPU replicas fit on a node (CR_Core counts CPUs).
        return LocalSlurmSpec(
            state_dir=self.state_dir / "slurm", ctld_port=self.slurm_port, cpus_per_node=4
        )

    def _pid_file(self, service: str) -> Path:
        return self.run_dir / f"{service}.pid"

    def _alive_pid(self, service: str) -> int | None:
        try:
            pid = int(self._pid_file(service).read_text())
        except (OSError, ValueError):
            return None
        started = self._started.get(service)
        if started is not None:
            started.poll()  # reaps our own child once it exited
        return pid if pid_alive(pid) else None

    def _start_service(self, service: str) -> None:
        if self._alive_pid(service):
            say(f"{service} already running")
            return
        private_dir(self.run_dir)
        private_dir(self.log_dir)
        env = dict(os.environ)
        config = load_config(self.config_path)
        if config.slurm.conf:
            env["SLURM_CONF"] = config.slurm.conf
        with open(self.log_dir / f"{service}.log", "ab", opener=private_opener) as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hpcserve.cli", service, "--config", str(self.config_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self._started[service] = proc
        self._pid_file(service).write_text(str(proc.pid))
        say(f"started {service} (pid {proc.pid}, log {self.log_dir / (service + '.log')})")

    def _gateway_url(self, config: PlatformConfig) -> str:
        host = config.gateway.host if config.gateway.host not in ("0.0.0.0", "") else "127.0.0.1"
        return f"http://{host}:{config.gateway.port}"

    def _wait_for_replica(self, config: PlatformConfig, timeout_s: float) -> None:
        from hpcserve.contracts.router_client import RouterQueryError, list_models

        wanted = {pool.model for pool in config.pools if pool.replicas > 0}
        started = time.monotonic()
        next_report = started
        say(
            f"waiting for a replica of {', '.join(sorted(wanted))} to register "
            "(a vLLM CPU engine takes ~1 min to load)"
        )
        while True:
            for service in services(config):
                if self._alive_pid(service) is None:
                    raise StackError(f"{service} exited; see {self.log_dir / (service + '.log')}")
            try:
                live = {
                    m.id
                    for m in list_models(
                        config.router.gateways_dial(), 1.0, curve_dir=config.router.curve_dir
                    )
                    if m.replicas > 0
                }
            except RouterQueryError:
                live = set()
            if wanted <= live:
                say(f"replica registered after {time.monotonic() - started:.0f}s")
                return
            now = time.monotonic()
            if now - started > timeout_s:
                raise StackError(f"no replica registered within {timeout_s:g}s (--timeout)")
            if now >= next_report:
                say(f"  {now - started:4.0f}s: {self._jobs_summary(config)}")
                next_report = now + 15
            time.sleep(1)

    def _jobs_summary(self, config: PlatformConfig) -> str:
        from hpcserve.status import collect_jobs

        try:
            jobs = collect_jobs(config)
        except Exception as err:
            return f"(cannot read jobs: {err})"
        if not jobs:
            return "no job yet"
        return "; ".join(
            f"job {j['job_id']} {j['state']}"
            + (f" on {j['node']}" if j["node"] else "")
            + (f" ({j['reason']})" if j["reason"] not in ("", "None") else "")
            for j in jobs
        )

    def _greet(self, config: PlatformConfig) -> None:
        url = self._gateway_url(config)
        key = self.key_file.read_text().strip() if self.key_file.exists() else "<your key>"
        model = config.pools[0].model if config.pools else "<model>"
        say(f"endpoint: {url}/v1")
        say(f"API key:  {key}")
        say("try it:")
        body = json.dumps(
            {"model": model, "max_tokens": 32, "messages": [{"role": "user", "content": "Hello!"}]}
        )
        print(
            f"  curl -s {url}/v1/chat/completions -H 'Authorization: Bearer {key}' \\\n"
            f"    -H 'Content-Type: application/json' -d '{body}'",
            flush=True,
        )
        request = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=body.encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                answer = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as err:
            say(f"the first chat request failed: {err}")
            return
        choice = answer["choices"][0]
        say(
            f"reply from {answer['model']} (random weights, so gibberish): "
            f"{choice['message']['content']!r} [finish_reason={choice['finish_reason']}, "
            f"tokens={answer['usage']['total_tokens']}]"
        )
        say("stop everything with `make down` (or `hpcserve down`)")

    def _print_log_tails(self) -> None:
        for log_file in sorted(self.log_dir.glob("*.log")) + sorted(
            (self.state_dir / "jobs").glob("*.out")
        ):
            lines = log_file.read_text(errors="replace").splitlines()[-15:]
            say(f"--- last lines of {log_file}")
            for line in lines:
                print(f"    {line}")

    # -- down -------------------------------------------------------------------------------

    def down(self) -> int:
        from hpcserve.localslurm import LocalSlurm
        from hpcserve.slurm.client import SlurmError

        config = load_config(self.config_path) if self.config_path.exists() else None
        local_cluster = None
        if config is not None and config.slurm.conf.startswith(str(self.state_dir)):
            local_cluster = LocalSlurm(self._local_slurm_spec())
        self._stop_service("poolmgr", timeout_s=60)
        self._stop_service("batch-runner", timeout_s=30)
        slurm_reachable = local_cluster is None or local_cluster.is_running()
        if config is not None and config.poolmgr.launcher == "slurm" and slurm_reachable:
            try:
                self._stop_jobs(config)
            except SlurmError as err:
                say(f"could not drain the jobs: {err}")
        self._stop_service("gateway", timeout_s=30)
        self._stop_service("router", timeout_s=15)
        if local_cluster is not None and local_cluster.is_running():
            say("stopping the local Slurm cluster")
            local_cluster.stop()
        left = self._leftovers()
        if left:
            say(f"{len(left)} processes of this stack were left behind; killing them:")
            for pid in sorted(left):
                say(f"  {pid}: {left[pid]}")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            return 1
        say("stopped")
        return 0

    def _leftovers(self) -> dict[int, str]:
        """What of this stack still runs: its programs (python, bash, hpcserve, slurmstepd)
        that name the state dir in their command line, every process of a session or process
        group one of them leads, and all their descendants. An engine's vLLM runs in its own
        session under a keeper whose command line names the model in the state dir; its
        engine core and workers rename themselves and blank their environment, so they are
        found by session and parentage, never by name. `{pid: what}`, zombies left out."""
        table: dict[int, tuple[int, int, int]] = {}  # pid -> (ppid, pgid, sid), live ones
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                raw = (entry / "stat").read_bytes().decode(errors="replace")
            except OSError:
                continue
            fields = raw[raw.rfind(")") + 2 :].split()
            if len(fields) >= 4 and fields[0] not in ("Z", "X"):
                table[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[3]))
        mine = {0}
        pid = os.getpid()
        while pid > 1 and pid not in mine:  # this process and its ancestors are not leftovers
            mine.add(pid)
            pid = table.get(pid, (0, 0, 0))[0]
        programs = ("python", "bash", "hpcserve", "slurmstepd")
        seeds = {
            pid
            for pid in table
            if pid not in mine
            and (argv := _cmdline(pid))
            and Path(argv[0]).name.startswith(programs)
            and any(str(self.state_dir) in arg for arg in argv)
        }
        found = seeds | {p for p, (_, pgid, sid) in table.items() if {pgid, sid} & seeds}
        grew = True
        while grew:
            more = {p for p, (ppid, _, _) in table.items() if ppid in found} - found
            found |= more
            grew = bool(more)
        return {pid: " ".join(_cmdline(pid)) or "?" for pid in found - mine if pid in table}

    def _stop_service(self, service: str, *, timeout_s: float) -> None:
        pid = self._alive_pid(service)
        if pid is None:
            self._pid_file(service).unlink(missing_ok=True)
            return
        say(f"stopping {service} (pid {pid})")
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._alive_pid(service):
            time.sleep(0.2)
        if self._alive_pid(service):
            say(f"{service} did not stop within {timeout_s:g}s; killing it")
            os.killpg(pid, signal.SIGKILL)
        started = self._started.pop(service, None)
        if started is not None:
            started.wait()
        self._pid_file(service).unlink(missing_ok=True)

    def _stop_jobs(self, config: PlatformConfig) -> None:
        from hpcserve.poolmgr.launchers import make_launcher
        from hpcserve.poolmgr.shutdown import drain_all_jobs

        drain_all_jobs(make_launcher(config), config, say)
