"""`hpcserve engine`: what runs inside a Slurm job (or a local process).

Starts vLLM's OpenAI server on a free port, waits for /health showing progress, compares
its greedy decodes with the version's golden record where there is one (numerical
canaries, health/canary.py: a mismatch fails the engine before it registers), registers
the replica with the router and heartbeats its load. On SIGTERM,
SIGUSR1 or SIGINT it deregisters first (gateways stop sending new work), then
sends SIGTERM to vLLM's API server process only, which drains in-flight
requests for up to --drain-s and exits. If vLLM dies on its own the replica
deregisters and the command exits non-zero, so Slurm records a failed job and
the pool manager replaces it.

The engine owns vLLM's whole process tree (process_tree.py): vLLM runs in a session of its
own under a keeper that ends the tree when the engine is gone, SIGKILL included. A vLLM not
serving yet has nothing to drain and is stopped at once (SIGTERM to the whole tree, SIGKILL
after 5 s); whatever way vLLM stops, nothing of its tree is left, and one line says what
was stopped and how.

A replica across several nodes (`--nnodes N`, one `hpcserve engine` per node started by
`srun`, its rank from SLURM_NODEID) runs the above on node rank 0 only, which also listens
on `--head-port` for the other ranks (lifeline.py). Each other rank starts a headless vLLM
that joins rank 0's, registers nothing, and stops its vLLM once rank 0's engine closes the
link, which rank 0 does only after its own vLLM has exited: the workers outlive the drain.
`--drain-file` makes rank 0 drain when that file appears (what the multi-node job script
uses, since Slurm's signals to a step reach every process of it, vLLM's included).
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcserve.contracts import protocol as p
from hpcserve.contracts.engine_args import (
    KV_TRANSFER_MAX_MB,
    KV_TRANSFER_TTL_S,
    NIXL_CONNECTOR,
    PD_ROLES,
    STORAGE_CONNECTOR,
    kv_connector_of,
    kv_storage_dir_of,
)
from hpcserve.contracts.engine_token import FILE_ENV, EngineTokenError, read_token
from hpcserve.contracts.private_files import private_dir
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.engine_launch.engine_ports import (
    HTTP,
    PORT_RETRIES,
    EnginePort,
    bindable_like_vllm,
    can_retry,
    describe_taken,
    engine_ports,
    port_failure,
    respec,
    taken_ports,
)
from hpcserve.engine_launch.kv_janitor import MB, JanitorThread, KvJanitor
from hpcserve.engine_launch.kv_relay import KvEventRelay
from hpcserve.engine_launch.lifeline import HeadLink, WorkerLink
from hpcserve.engine_launch.load import parse_vllm_load
from hpcserve.engine_launch.lora import RuntimeAdapters, read_plan, stage_adapter
from hpcserve.engine_launch.process_tree import VllmTree, describe_pids
from hpcserve.engine_launch.topology import TopologyError, replica_node_rank, topology_from_env
from hpcserve.engine_launch.vllm_args import (
    HTTP_FD_VARIABLE,
    EngineSpec,
    block_size,
    describe_env,
    kv_events_args,
    kv_events_endpoints,
    vllm_argv,
    vllm_env,
)
from hpcserve.port_reservations import PortReservation
from hpcserve.ports import reserve_ports

if TYPE_CHECKING:
    from hpcserve.health.replica import EngineHealth, WorkerHealth

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    model_path: str
    served_model_name: str
    router: str
    pool: str = ""
    engine: str = "vllm"
    python: str = ""
    bind_host: str = "0.0.0.0"
    advertise_host: str = ""
    port: int = 0
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    heartbeat_s: float = 2.0
    ready_timeout_s: float = 900.0
    drain_s: int = 30
    cache_dir: str = ""
    manifest: str = ""
    model_ref: str = ""
    extra_args: tuple[str, ...] = ()
    # A replica across nodes: node count, this node's rank (-1: SLURM_NODEID), where rank 0
    # hosts torch.distributed (master) and its engine's link to the other ranks (head port).
    nnodes: int = 1
    node_rank: int = -1
    master_addr: str = ""
    master_port: int = 0
    head_port: int = 0
    # Drain when this file appears (rank 0 only).
    drain_file: str = ""
    # How long a rank > 0 tries to reach rank 0's engine, which starts at the same time.
    head_connect_timeout_s: float = 120.0
    # LoRA on: the pool's plan (engine_launch/lora.py), written by the pool manager.
    lora_plan: str = ""
    # CURVE keys for the registry socket (contracts/curve.py); empty: plain.
    curve_dir: str = ""
    # The pool's role (pools[].role), told to the router in Register.
    role: str = "interactive"
    # The deployment's engine token (contracts/engine_token.py): vLLM answers 401 to anyone
    # without it. Empty: no token, vLLM serves anyone who reaches its port (warned).
    engine_token_file: str = ""
    # The version's golden record (numerical canaries, health/canary.py): checked before the
    # replica registers and then by the health monitor. Empty: no canary.
    canary_record: str = ""
    # A prefill or decode replica on the storage connector sweeps its directory
    # (engine_launch/kv_janitor.py): pools[].kv_transfer_ttl_s and kv_transfer_max_mb.
    kv_transfer_ttl_s: float = KV_TRANSFER_TTL_S
    kv_transfer_max_mb: int = KV_TRANSFER_MAX_MB
    # vLLM in a network namespace of its own (private_net.py): "auto" (where the kernel
    # allows it), "required" or "off". A replica across nodes or with a NIXL side channel
    # runs in the node's namespace whatever this says (other nodes must reach it).
    private_network: str = "auto"


PRIVATE_NETWORK_MODES = ("auto", "required", "off")
# Connections the HTTP socket the engine makes for vLLM queues before vLLM accepts them
# (uvicorn's default backlog).
HTTP_BACKLOG = 2048


class EngineFailed(RuntimeError):
    pass


# The engine's private directory, <tmp>/hpcserve-kv-<engine pid>-XXXXXXXX (open_private_dir):
# vLLM's ipc:// sockets (its own and the KV-event ones) and temporary files.
KV_DIR_PREFIX = "hpcserve-kv-"


def sweep_kv_dirs(parent: Path) -> None:
    """Remove this account's KV-event directories whose engine is gone (a SIGKILLed engine
    cannot remove its own)."""
    for path in parent.glob(f"{KV_DIR_PREFIX}*-*"):
        pid = path.name[len(KV_DIR_PREFIX) :].partition("-")[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.geteuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # alive under another account, or gone meanwhile


def make_kv_storage_private(engine_args: Sequence[str]) -> None:
    """The storage connector's directory holds prompts' KV blocks: tenants' data, so only the
    service account may enter it (docs/security.md)."""
    if storage := kv_storage_dir_of(engine_args):
        private_dir(storage)


def _http_get(url: str, timeout_s: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, ""


class EngineRunner:
    def __init__(self, options: EngineOptions) -> None:
        self.topology = topology_from_env(os.environ)
        if "{node}" in options.cache_dir:  # one cache per node where nodes share a disk (tests)
            node = self.topology.node or socket.gethostname()
            options = replace(options, cache_dir=options.cache_dir.replace("{node}", node))
        self.options = options
        self.node_rank = replica_node_rank(self.topology, options.nnodes, options.node_rank)
        if options.nnodes > 1 and not (
            options.master_addr and options.master_port and options.head_port
        ):
            raise TopologyError(
                f"--nnodes {options.nnodes} needs --master-addr, --master-port and --head-port "
                f"(got {options.master_addr!r}, {options.master_port}, {options.head_port})"
            )
        # Ports the engine chose, reserved on this host until it exits (hpcserve/ports.py).
        self.reservations: list[PortReservation] = []
        self.port = options.port or self.reserve_port(options.bind_host)
        advertise = options.advertise_host or socket.gethostname()
        self.advertise_host = advertise
        self._set_urls()
        self.spec = EngineSpec(
            model_path=options.model_path,
            served_model_name=options.served_model_name,
            engine=options.engine,
            python=options.python or sys.executable,
            bind_host=options.bind_host,
            port=self.port,
            tensor_parallel=options.tensor_parallel,
            pipeline_parallel=options.pipeline_parallel,
            drain_s=options.drain_s,
            extra_args=options.extra_args,
            nnodes=options.nnodes,
            node_rank=self.node_rank,
            master_addr=options.master_addr,
            master_port=options.master_port,
        )
        # KV-cache events for the router's prefix index (router/kv_subscriber.py): vLLM
        # publishes on ipc:// sockets in a private directory (open_kv_events), this engine's
        # agent relays them to the router (kv_relay.py).
        self.kv_events = options.engine in ("vllm", "vllm-cpu", "sim") and self.node_rank == 0
        self.kv_relay: KvEventRelay | None = None
        job = self.topology.job_id
        self.replica_id = (
            f"{options.pool or options.served_model_name}-"
            + (f"j{job}" if job else f"{socket.gethostname()}-{os.getpid()}")
            + f"-{uuid.uuid4().hex[:6]}"
        )
        if self.kv_events:
            self.spec = replace(self.spec, kv_events_topic=self.replica_id)
        # A prefill or decode replica over NIXL: its own side-channel port, at the address
        # other nodes reach it by (contracts/engine_args.py kv_transfer_args).
        self.kv_connector = kv_connector_of(options.extra_args)
        if self.kv_connector == NIXL_CONNECTOR and self.node_rank == 0:
            self.spec = replace(
                self.spec, nixl_host=advertise, nixl_port=self.reserve_port(options.bind_host)
            )
        if options.private_network not in PRIVATE_NETWORK_MODES:
            raise EngineFailed(
                f"--private-network must be one of {', '.join(PRIVATE_NETWORK_MODES)}, "
                f"got {options.private_network!r}"
            )
        if (
            options.engine in ("vllm", "vllm-cpu")
            and options.nnodes == 1
            and self.kv_connector != NIXL_CONNECTOR
        ):
            self.spec = replace(self.spec, private_network=options.private_network)
        self._stop = threading.Event()
        self._stop_reason = ""
        self._rank_lost = ""
        # vLLM's tree (process_tree.py); serving once vLLM answered /health (a headless rank:
        # once it joined the head), before which a stop has nothing to drain.
        self.process: VllmTree | None = None
        self._serving = False
        self.lora: RuntimeAdapters | None = None
        self.health: EngineHealth | None = None
        self._gave_up = ""  # the health monitor gave up on this engine: stop vLLM hard
        self.engine_token = ""  # load_engine_token(); never logged
        self.port_grace_s = 5.0
        self.kv_janitor = self._kv_janitor()

    def _kv_janitor(self) -> JanitorThread | None:
        """A prefill or decode replica on the storage connector (rank 0) sweeps its directory
        (kv_janitor.py); NIXL replicas and all others have no files to sweep."""
        storage = kv_storage_dir_of(self.options.extra_args)
        if (
            self.kv_connector != STORAGE_CONNECTOR
            or not storage
            or self.options.role not in PD_ROLES
            or self.node_rank != 0
        ):
            return None
        ttl_s = self.options.kv_transfer_ttl_s
        janitor = KvJanitor(Path(storage), ttl_s, self.options.kv_transfer_max_mb * MB)
        return JanitorThread(janitor, JanitorThread.interval_for(ttl_s))

    def _set_urls(self) -> None:
        bind_host = self.options.bind_host
        local_host = "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host
        self.local_url = f"http://{local_host}:{self.port}"
        self.public_url = f"http://{self.advertise_host}:{self.port}"

    def reserve_port(self, host: str = "") -> int:
        [reservation] = reserve_ports(1, host)
        self.reservations.append(reservation)
        return reservation.port

    def release_ports(self) -> None:
        for reservation in self.reservations:
            reservation.release()
        self.reservations = []

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            log.info("stop requested: %s", reason)
            self._stop.set()

    def on_rank_lost(self, rank: int) -> None:
        """Rank 0: another rank's engine went away; its vLLM workers are gone with it."""
        if not self._stop.is_set():
            self._rank_lost = f"the engine of node rank {rank} is gone (its vLLM workers with it)"
            self.request_stop(self._rank_lost)

    def watch_drain_file(self, path: str) -> None:
        def watch() -> None:
            while not self._stop.is_set():
                if os.path.exists(path):
                    self.request_stop(f"drain requested ({path})")
                    return
                self._stop.wait(0.5)

        threading.Thread(target=watch, name="drain-file", daemon=True).start()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, lambda num, _f: self.request_stop(signal.Signals(num).name))

    def stage_model(self) -> None:
        """Copy the model into the node-local cache (or find it there, verified) and point
        vLLM at the copy; the engine holds a lease on it so it is not evicted while in use."""
        from hpcserve.modelcache.cache import NodeCache
        from hpcserve.modelcache.errors import CacheError
        from hpcserve.modelcache.manifest import decode_manifest
        from hpcserve.modelcache.progress import Progress
        from hpcserve.modelcache.refs import parse_ref
        from hpcserve.modelcache.stage import stage

        if not self.options.cache_dir:
            raise EngineFailed("--manifest needs --cache-dir (engine.cache_dir in the config)")
        try:
            ref = parse_ref(self.options.model_ref)
            if ref.version is None:
                raise ValueError(f"--model-ref {ref} names no version (expected name@N)")
            manifest = decode_manifest(Path(self.options.manifest).read_bytes())
            cache = NodeCache(Path(self.options.cache_dir))
            with Progress(f"staging {ref}", manifest.total_bytes) as progress:
                staged = stage(
                    manifest,
                    Path(self.options.model_path),
                    cache,
                    name=ref.name,
                    version=ref.version,
                    progress=progress,
                    lease_pid=os.getpid(),
                )
        except (CacheError, OSError, ValueError) as err:
            raise EngineFailed(f"cannot stage {self.options.model_ref}: {err}") from None
        log.info(
            "model %s %s at %s (%.1f GB in %.1fs)",
            self.options.model_ref,
            "staged" if staged.copied else "found in the node cache",
            staged.path,
            staged.bytes / 1e9,
            staged.seconds,
        )
        self.spec = replace(self.spec, model_path=str(staged.path))

    def start_vllm(self) -> None:
        make_kv_storage_private(self.spec.extra_args)
        argv = vllm_argv(self.spec)
        env = vllm_env(self.spec, os.environ, engine_token=self.engine_token)
        what = "headless vLLM" if self.spec.headless else "vLLM"
        if self.process is not None:  # a restart: nothing of the last one may stay
            self.stop_vllm()
        self._serving = False
        http = self._http_socket() if self.spec.private_network != "off" else None
        try:
            if http is not None:
                env[HTTP_FD_VARIABLE] = str(http.fileno())
            self.process = VllmTree(argv, env, pass_fds=() if http is None else (http.fileno(),))
        finally:
            if http is not None:
                http.close()  # vLLM holds it now: its port is free again when vLLM exits
        log.info(
            "starting %s in session %d (its own process group): %s (environment: %s)",
            what,
            self.process.session,
            shlex.join(argv),
            describe_env(env),
        )

    def _http_socket(self) -> socket.socket:
        """vLLM's HTTP socket, bound and listening in the node's network namespace, as vLLM
        would bind it (launcher.create_server_socket: SO_REUSEADDR); EngineFailed when the
        port is taken (launch_vllm then picks another where it chose this one)."""
        host = "" if self.spec.bind_host in ("0.0.0.0", "*") else self.spec.bind_host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self.spec.port))
            sock.listen(HTTP_BACKLOG)
        except OSError as err:
            sock.close()
            raise EngineFailed(
                f"cannot bind vLLM's HTTP port {host or '0.0.0.0'}:{self.spec.port}: {err.strerror}"
            ) from None
        return sock

    def launch_vllm(self) -> None:
        """Start vLLM and wait until it is ready; restart it on new ports when it exited
        because one it was to bind had been taken meanwhile (engine_ports.py)."""
        for retries_done in itertools.count():
            try:
                self.start_vllm()
                self.wait_ready()
                return
            except EngineFailed as err:
                taken = self.ports_taken()
                if not taken:
                    raise
                if not can_retry(taken, retries_done):
                    raise EngineFailed(port_failure(str(err), taken, retries_done)) from None
                log.warning(
                    "vLLM exited before it was ready: %s; restarting it on new ports "
                    "(retry %d of %d)",
                    describe_taken(taken),
                    retries_done + 1,
                    PORT_RETRIES,
                )
                self.replace_ports(taken)

    def ports_taken(self) -> list[EnginePort]:
        """The ports vLLM was to bind that another process holds (vLLM must have exited).
        A port still held after `port_grace_s` is not one of vLLM's exiting children's."""
        if self.process is not None and self.process.poll() is None:
            return []  # vLLM is running: it holds them
        taken = engine_ports(self.spec, http_chosen=not self.options.port)
        deadline = time.monotonic() + self.port_grace_s
        while True:
            taken = taken_ports(taken, bindable_like_vllm)
            if not taken or time.monotonic() >= deadline:
                return taken
            time.sleep(0.5)

    def replace_ports(self, taken: list[EnginePort]) -> None:
        new: dict[str, int] = {}
        for port in taken:
            for reservation in [r for r in self.reservations if r.port == port.port]:
                reservation.release()
                self.reservations.remove(reservation)
            new[port.socket] = self.reserve_port(port.host)
        self.spec = respec(self.spec, new)
        if HTTP in new:
            self.port = new[HTTP]
            self._set_urls()

    def wait_ready(self) -> None:
        assert self.process is not None
        started = time.monotonic()
        next_report = started + 10
        while not self._stop.is_set():
            code = self.process.poll()
            if code is not None:
                raise EngineFailed(f"vLLM exited with code {code} before it was ready")
            try:
                status, _ = _http_get(self.local_url + "/health", 2.0)
                if status == 200:
                    private = self._in_private_network()
                    log.info(
                        "vLLM ready at %s after %.0fs%s",
                        self.local_url,
                        time.monotonic() - started,
                        ", in a network namespace of its own" if private else "",
                    )
                    if private is False:
                        log.warning(
                            "vLLM runs in the node's network namespace: the kernel refused it "
                            "one of its own (the job output says why), so its workers' "
                            "loopback listeners are open to the node's other users"
                        )
                    self._serving = True
                    return
            except OSError:
                pass
            now = time.monotonic()
            if now - started > self.options.ready_timeout_s:
                raise EngineFailed(
                    f"vLLM not ready after {self.options.ready_timeout_s:g}s "
                    "(raise engine.ready_timeout_s / --ready-timeout-s to wait longer)"
                )
            if now >= next_report:
                log.info("waiting for vLLM /health: %.0fs elapsed", now - started)
                next_report = now + 10
            self._stop.wait(0.5)

    def _in_private_network(self) -> bool | None:
        """Whether vLLM got the network namespace asked for (`auto` runs it unshared where
        the kernel refuses: private_net.py); None when none was asked for."""
        if self.spec.private_network == "off" or self.process is None:
            return None
        try:
            return os.readlink(f"/proc/{self.process.pid}/ns/net") != os.readlink(
                "/proc/self/ns/net"
            )
        except OSError:
            return None

    def read_load(self) -> p.ReplicaLoad | None:
        try:
            status, text = _http_get(self.local_url + "/metrics", 2.0)
        except OSError:
            return None
        return parse_vllm_load(text) if status == 200 else None

    def registration(self) -> p.Register:
        return p.Register(
            replica_id=self.replica_id,
            model=self.options.served_model_name,
            url=self.public_url,
            pool=self.options.pool,
            slurm_job_id=self.topology.job_id,
            node=self.topology.node,
            tensor_parallel=self.options.tensor_parallel,
            pipeline_parallel=self.options.pipeline_parallel,
            **self._kv_events_registration(),
            adapters=[name for name, _ in self.spec.lora_modules],
            max_adapters=self.spec.max_loras,
            base_model=self.options.model_ref.partition("@")[0] or self.options.served_model_name,
            cached=self.node_cache_keys(),
            model_ref=self.options.model_ref,
            role=self.options.role,
            kv_connector=self.kv_connector,
        )

    def node_cache_keys(self) -> list[str]:
        """The entries of this node's model cache (for placement; empty without a cache)."""
        if not self.options.cache_dir or not os.path.isdir(self.options.cache_dir):
            return []
        from hpcserve.modelcache.cache import NodeCache

        try:
            return NodeCache(Path(self.options.cache_dir), check_local=False).entry_keys()
        except OSError as err:
            log.warning("cannot list the node cache %s: %s", self.options.cache_dir, err)
            return []

    def _kv_events_registration(self) -> dict[str, Any]:
        spec = self.spec
        if not kv_events_args(spec):
            return {"block_size": block_size(spec)}
        return {
            "block_size": block_size(spec),
            "kv_events_topic": spec.kv_events_topic,
            "kv_events_relayed": True,
        }

    def open_private_dir(self) -> str:
        """This engine's directory only its account may enter (mkdtemp: mode 0700), removed
        when it stops: vLLM's own ipc:// sockets between its API server, engine core and
        workers go there (VLLM_RPC_BASE_PATH; by default /tmp, where their mode follows the
        umask), its temporary files (TMPDIR: torch.distributed's file store) and the
        KV-event sockets."""
        if self.spec.runtime_dir:
            return self.spec.runtime_dir
        prefix = f"{KV_DIR_PREFIX}{os.getpid()}-"
        directory = tempfile.mkdtemp(prefix=prefix)
        # vLLM's ipc paths are <directory>/<uuid4> (36 characters): they must fit a
        # sockaddr_un (108 bytes).
        if len(directory) > 70:
            os.rmdir(directory)
            directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        sweep_kv_dirs(Path(directory).parent)
        self.spec = replace(self.spec, runtime_dir=directory)
        log.info("vLLM's sockets and temporary files in %s (mode 0700)", directory)
        return directory

    def close_private_dir(self) -> None:
        if self.spec.runtime_dir:
            shutil.rmtree(self.spec.runtime_dir, ignore_errors=True)

    def open_kv_events(self, agent: RegistryAgent) -> None:
        """vLLM's KV-event sockets in the engine's private directory (open_private_dir), and
        the relay that forwards them to the router once it tells where."""
        if not self.kv_events:
            return
        directory = self.open_private_dir()
        self.spec = replace(self.spec, kv_events_dir=directory)
        if not kv_events_args(self.spec):
            return  # the pool's engine_args configure events themselves
        events, replay = kv_events_endpoints(self.spec)
        self.kv_relay = KvEventRelay(
            events, replay, self.spec.kv_events_topic, curve_dir=self.options.curve_dir
        )
        self.kv_relay.start()
        agent.on_kv_relay = self.kv_relay.connect_router

    def close_kv_events(self) -> None:
        if self.kv_relay is not None:
            self.kv_relay.stop()
            self.kv_relay = None
        self.close_private_dir()

    def serve(self, agent: RegistryAgent) -> None:
        """Heartbeat until asked to stop or vLLM dies."""
        assert self.process is not None
        # Now that the model and adapters are staged: the static adapters, the cache's entries.
        agent.registration = self.registration()
        if self.spec.max_loras > 0:
            self.lora = RuntimeAdapters(
                self.local_url,
                self.options.cache_dir,
                list(agent.registration.adapters),
                engine_token=self.engine_token,
            )
            agent.on_load_adapter = self.lora.submit
        agent.register()
        self.health = self._start_health(agent)
        if self.kv_janitor is not None:
            self.kv_janitor.start()
        last_load = p.ReplicaLoad()
        while not self._stop.is_set():
            code = self.process.poll()
            if code is not None:
                raise EngineFailed(f"vLLM exited with code {code} while serving")
            last_load = self.read_load() or last_load
            if self.health is None or self.health.in_service:
                agent.heartbeat(last_load, self.lora.loaded if self.lora else None)
            deadline = time.monotonic() + self.options.heartbeat_s
            while not self._stop.is_set() and time.monotonic() < deadline:
                agent.process_replies(min(0.2, max(deadline - time.monotonic(), 0)))
                if self.health is not None:
                    self.health.step()
                for answer in self.lora.answers() if self.lora else ():
                    agent.send(answer)
                for sweep in self.kv_janitor.reports() if self.kv_janitor else ():
                    agent.send(
                        p.KvCleanupReport(
                            self.replica_id,
                            sweep.expired,
                            sweep.expired_bytes,
                            sweep.over_cap,
                            sweep.over_cap_bytes,
                            sweep.left_bytes,
                        )
                    )

    def _start_health(self, agent: RegistryAgent) -> EngineHealth | None:
        from hpcserve.health.replica import EngineHealth

        return EngineHealth.start(
            agent,
            agent.registration,
            engine=self.options.engine,
            engine_url=self.local_url,
            on_drain=self.request_stop,
            on_give_up=self._give_up,
            engine_token=self.engine_token,
            canary_record=self.options.canary_record,
        )

    def check_canary(self, agent: RegistryAgent) -> None:
        """Before registering: decode the golden record's canaries and compare. A mismatch
        is reported to the router as a health finding (the pool manager drains the node if
        the policy says so) and fails the engine unregistered: the job fails, and the pool
        manager's failure backoff slows the replacements. No record (yet): nothing to check."""
        from hpcserve.contracts.canary import CanaryError
        from hpcserve.contracts.canary_client import load_record
        from hpcserve.health.canary import CHECK, run_canary
        from hpcserve.health.monitor import health_config_from_env
        from hpcserve.health.policy import Policy

        path = self.options.canary_record
        if not path:
            return
        try:
            record = load_record(path)
            config = health_config_from_env(os.environ)
        except (CanaryError, ValueError) as err:
            raise EngineFailed(f"numerical canary: {err}") from None
        if record is None:
            log.info("numerical canary: no golden record at %s yet; checked once it appears", path)
            return
        ref = self.options.model_ref
        if ref and record.model_ref != ref:
            raise EngineFailed(f"{path} is the golden record of {record.model_ref}, not of {ref}")
        outcome = run_canary(
            record,
            self.local_url,
            self.options.served_model_name,
            engine_token=self.engine_token,
            deadline_s=config.canary_deadline_s,
        )
        reg = agent.registration
        agent.send(
            p.CanaryReport(
                reg.replica_id, record.model_ref, outcome.result, "before_register", outcome.detail
            )
        )
        if outcome.result == "pass":
            log.info(
                "numerical canary: matches the golden record of %s (%d prompts)",
                record.model_ref,
                len(record.answers),
            )
            return
        if outcome.result == "error":
            raise EngineFailed(f"numerical canary could not run: {outcome.detail}")
        finding = Policy(config).finding(CHECK, outcome.detail)
        log.warning("health: %s (check %s, action %s)", finding.detail, CHECK, finding.action)
        agent.send(
            p.HealthReport(
                replica_id=reg.replica_id,
                findings=[finding],
                node=reg.node,
                slurm_job_id=reg.slurm_job_id,
                pool=reg.pool,
            )
        )
        raise EngineFailed(f"{outcome.detail}: not registering")

    def _give_up(self, reason: str) -> None:
        self._gave_up = f"health: {reason}"
        self.request_stop(self._gave_up)

    def stop_vllm(self) -> int:
        """Stop vLLM's whole tree (process_tree.py) and log one line saying what was stopped
        and how; returns vLLM's exit code. Serving: drain (SIGTERM to the API server alone,
        up to drain_s + 15 s), then kill whatever is left. Not serving yet (loading, a
        headless rank that never joined): nothing to drain, SIGTERM to every process of the
        tree and SIGKILL after 5 s. Given up on by the health monitor: SIGKILL at once."""
        tree = self.process
        if tree is None:
            return 0
        pids = tree.members()
        if tree.poll() is not None and not pids:
            tree.close()
            return tree.returncode or 0
        started = time.monotonic()
        if self._gave_up:
            tree.kill()
            how = f"killed (SIGKILL: {self._gave_up})"
        elif tree.poll() is not None:
            how = f"exited (code {tree.returncode}); what it left " + tree.terminate()
        elif not self._serving:
            how = "not serving yet, nothing to drain: " + tree.terminate()
        else:
            wait_s = self.options.drain_s + 15
            log.info("draining vLLM (pid %d) for up to %ds", tree.pid, self.options.drain_s)
            tree.signal_api(signal.SIGTERM)
            if tree.wait(wait_s) is None:
                tree.kill()
                how = f"killed (SIGKILL): the drain did not end within {wait_s}s"
            else:
                how = "drained"
        left = tree.close()
        if left:
            how += f"; killed pids {describe_pids(left)} left behind"
        log.info(
            "vLLM stopped: %s in %.1fs; its process tree (session %d): pids %s; exit code %s",
            how,
            time.monotonic() - started,
            tree.session,
            describe_pids(pids),
            tree.returncode,
        )
        return tree.returncode or 0

    def prepare_model(self) -> None:
        if self.options.engine != "sim" and not os.path.isdir(self.options.model_path):
            raise EngineFailed(
                f"model path {self.options.model_path!r} is not a directory on node "
                f"{self.topology.node} (weights are read from disk, never downloaded)"
            )
        if self.options.manifest:
            self.stage_model()
        if self.options.lora_plan:
            self.stage_static_adapters()

    def load_engine_token(self) -> None:
        """The deployment's engine token: vLLM gets it (environment) and the guard (argv);
        this engine presents it to vLLM itself (probes, LoRA loads)."""
        path = self.options.engine_token_file
        if not path:
            log.warning(
                "no --engine-token-file ($%s): vLLM answers anyone who reaches port %d",
                FILE_ENV,
                self.port,
            )
            return
        try:
            self.engine_token = read_token(path)
        except EngineTokenError as err:
            raise EngineFailed(f"{err} (--engine-token-file, engine.token_file)") from None
        self.spec = replace(self.spec, token_guard=True)
        log.info("vLLM answers only callers with the engine token of %s", path)

    def stage_static_adapters(self) -> None:
        """Turn LoRA on as the pool's plan says; stage its static adapters (--lora-modules)."""
        from hpcserve.modelcache.errors import CacheError

        if not self.options.cache_dir:
            raise EngineFailed("--lora-plan needs --cache-dir (engine.cache_dir in the config)")
        try:
            plan = read_plan(self.options.lora_plan)
            cache = self.options.cache_dir
            modules = tuple(
                (a.name, str(stage_adapter(a.name, a.source, a.manifest.encode(), cache)))
                for a in plan.adapters
            )
        except (CacheError, OSError, ValueError) as err:
            raise EngineFailed(f"cannot stage the LoRA adapters: {err}") from None
        self.spec = replace(
            self.spec,
            max_loras=plan.max_loras,
            max_lora_rank=plan.max_lora_rank,
            lora_modules=modules,
        )

    def run(self) -> int:
        self.install_signal_handlers()
        if self.node_rank > 0:
            return self.run_headless()
        head_link: HeadLink | None = None
        if self.options.drain_file:
            self.watch_drain_file(self.options.drain_file)
        agent = RegistryAgent(
            self.options.router, self.registration(), curve_dir=self.options.curve_dir
        )
        failure: EngineFailed | None = None
        try:
            if self.options.nnodes > 1:
                log.info(
                    "node rank 0 of %d: API server; torch.distributed at %s:%d; the other "
                    "ranks' engines join this one on port %d",
                    self.options.nnodes,
                    self.options.master_addr,
                    self.options.master_port,
                    self.options.head_port,
                )
                try:
                    head_link = HeadLink(self.options.head_port, on_lost=self.on_rank_lost)
                except OSError as err:
                    raise EngineFailed(
                        f"cannot listen on --head-port {self.options.head_port}: {err}"
                    ) from None
            self.load_engine_token()
            self.prepare_model()
            self.open_private_dir()
            self.open_kv_events(agent)
            self.launch_vllm()
            if not self._stop.is_set():
                self.check_canary(agent)
                self.serve(agent)
            if self._rank_lost:
                raise EngineFailed(self._rank_lost)
            if self._gave_up:
                raise EngineFailed(self._gave_up)
        except EngineFailed as err:
            failure = err
            log.error("engine failed: %s", err)
        finally:
            agent.deregister(self._stop_reason or (str(failure) if failure else "stopping"))
            agent.close()
            if self.health is not None:
                self.health.stop()
            if self.kv_janitor is not None:
                self.kv_janitor.stop()
            code = self.stop_vllm()
            self.close_kv_events()
            self.release_ports()
            log.info("engine stopped (vLLM exit code %s)", code)
            if head_link is not None:
                head_link.close()  # now the other ranks stop their workers
        return 1 if failure else 0

    def run_headless(self) -> int:
        """Node rank > 0: headless vLLM workers for rank 0's API server, until rank 0's
        engine closes the link (its vLLM has exited) or this engine is told to stop."""
        head = f"{self.options.master_addr}:{self.options.head_port}"
        log.info(
            "node rank %d of %d: headless vLLM workers; head engine at %s",
            self.node_rank,
            self.options.nnodes,
            head,
        )
        failure: EngineFailed | None = None
        link: WorkerLink | None = None
        health: WorkerHealth | None = None
        try:
            self.prepare_model()
            self.open_private_dir()
            self.start_vllm()
            assert self.process is not None
            proc = self.process
            try:
                link = WorkerLink.connect(
                    self.options.master_addr,
                    self.options.head_port,
                    self.node_rank,
                    timeout_s=self.options.head_connect_timeout_s,
                    keep_trying=lambda: not self._stop.is_set() and proc.poll() is None,
                )
            except ConnectionError as err:
                if not self._stop.is_set() and proc.poll() is None:
                    raise EngineFailed(str(err)) from None
            if link is not None:
                log.info("joined the head engine at %s", head)
                self._serving = True  # stopped with SIGTERM to vLLM alone, as it expects
                health = self._start_worker_health()
            while link is not None and not self._stop.is_set():
                code = proc.poll()
                if code is not None:
                    raise EngineFailed(f"headless vLLM exited with code {code}")
                if link.head_gone(0.5):
                    log.info("the head engine closed the link: stopping the workers")
                    break
                reason = health.step() if health is not None else ""
                if reason:
                    # Rank 0 sees this rank go and fails the replica; the pool manager
                    # drains this node from the report.
                    raise EngineFailed(f"health: {reason}")
            if link is None and proc.poll() is not None and not self._stop.is_set():
                raise EngineFailed(f"headless vLLM exited with code {proc.returncode}")
        except EngineFailed as err:
            failure = err
            log.error("engine failed: %s", err)
        finally:
            if health is not None:
                health.stop()
            if link is not None:
                link.close()
            code = self.stop_vllm()
            self.close_private_dir()
            self.release_ports()
            log.info("engine stopped (vLLM exit code %s)", code)
        return 1 if failure else 0

    def _start_worker_health(self) -> WorkerHealth | None:
        from hpcserve.health.replica import WorkerHealth

        registration = p.Register(
            replica_id=f"{self.replica_id}-rank{self.node_rank}",
            model=self.options.served_model_name,
            url="",
            pool=self.options.pool,
            slurm_job_id=self.topology.job_id,
            node=self.topology.node or socket.gethostname(),
        )
        agent = RegistryAgent(self.options.router, registration, curve_dir=self.options.curve_dir)
        return WorkerHealth.start(agent, registration)
