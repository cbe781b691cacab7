"""Many simulated replicas in one process: a fleet for control-plane scale tests.

One `hpcserve engine --engine sim` per replica costs a Python interpreter, Starlette,
ZeroMQ and a supervisor each (two processes per replica); 64 of them take most of a small
machine's CPU just to start. A fleet instead runs N ``SimEngine``s on one asyncio loop:
one uvicorn server listens on N sockets (one port per replica) and hands each connection
to the engine whose port it arrived on; each replica has its own KV-event publisher
(vLLM's wire, PUB + replay ports) and its own registry DEALER, so the router sees N
ordinary replicas: it cannot tell them from N separate engines. One thread registers
and heartbeats them all. SIGTERM or SIGINT deregisters every replica, then stops.

    python -m hpcserve.sim.fleet --replicas 64 --router tcp://127.0.0.1:5560 \\
        --served-model-name chat --model MODEL_DIR --sim-gpu h100 --sim-model llama-3.1-8b

prints one ``fleet ready: N replicas ...`` line once every replica is registered
(acknowledged by the router). All replicas share the process's CPU: a fleet models N GPUs,
not N CPUs, so keep the modelled work per second within what one core can step through
(``--time-scale`` > 1 slows the modelled GPUs down).

Failure mode: when the loop is short of CPU every replica's steps end late together,
which shows up as slower modelled GPUs, not as errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import uvicorn

from hpcserve.contracts import protocol as p
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.ports import free_ports
from hpcserve.sim.engine import KVEventsConfig, SimConfig, SimEngine
from hpcserve.sim.options import OptionsError, add_arguments, sim_config
from hpcserve.sim.server import build_app
from hpcserve.sim.tokenizer import SimTokenizer, load_tokenizer

log = logging.getLogger(__name__)

KV_TOPIC = "kv-events"


def _bound_socket(host: str) -> socket.socket:
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections of a socket whose
    # proto says TCP, and without it each SSE chunk that follows an unacknowledged one
    # waits out the client's delayed ACK (~40 ms), which a real vLLM (uvloop) never does.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


@dataclass
class FleetReplica:
    index: int
    engine: SimEngine
    sock: socket.socket
    registration: p.Register
    agent: RegistryAgent | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])


class PortDispatch:
    """ASGI: each request goes to the app of the port it arrived on; lifespan to all."""

    def __init__(self, apps: dict[int, Any], engines: list[SimEngine]) -> None:
        self.apps = apps
        self.engines = engines

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    for engine in self.engines:
                        await engine.start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    for engine in self.engines:
                        await engine.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        server = scope.get("server") or ("", 0)
        await self.apps[server[1]](scope, receive, send)


class SimFleet:
    def __init__(
        self,
        replicas: int,
        config: SimConfig,
        tokenizer: SimTokenizer,
        *,
        router: str,
        pool: str = "",
        role: str = "interactive",
        host: str = "127.0.0.1",
        advertise_host: str = "",
        heartbeat_s: float = 2.0,
        kv_events: bool = True,
        block_size: int = 16,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"--replicas: must be >= 1, got {replicas}")
        self.router = router
        self.heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self.ready = threading.Event()
        advertise = advertise_host or host
        run_id = uuid.uuid4().hex[:6]
        self.replicas: list[FleetReplica] = []
        # The KV-event sockets bind when the engines start, after these are chosen: from
        # below the ephemeral range, where outgoing connections and port-0 binds never land.
        kv_ports = free_ports(2 * replicas, "*") if kv_events else []
        for i in range(replicas):
            sock = _bound_socket(host)
            port = int(sock.getsockname()[1])
            kv: dict[str, Any] = {"block_size": config.hardware.block_size}
            replica_config = config
            replica_id = f"{pool or config.served_model_name}-sim{i}-{run_id}"
            if kv_events:
                pub, replay = kv_ports[2 * i], kv_ports[2 * i + 1]
                # One topic per replica, as engine agents publish: the router tells the
                # streams on its one SUB socket apart by topic.
                topic = f"{KV_TOPIC}-{replica_id}"
                replica_config = replace(
                    config,
                    kv_events=KVEventsConfig(f"tcp://*:{pub}", f"tcp://*:{replay}", topic),
                )
                kv |= {
                    "kv_events_endpoint": f"tcp://{advertise}:{pub}",
                    "kv_replay_endpoint": f"tcp://{advertise}:{replay}",
                    "kv_events_topic": topic,
                }
            registration = p.Register(
                replica_id=replica_id,
                model=config.served_model_name,
                url=f"http://{advertise}:{port}",
                pool=pool,
                node=socket.gethostname(),
                max_model_len=config.limits.max_model_len,
                **kv,
                role=role,
                kv_connector=config.kv_transfer.connector if config.kv_transfer else "",
            )
            engine = SimEngine(replica_config, tokenizer)
            self.replicas.append(FleetReplica(i, engine, sock, registration))
        apps = {r.port: build_app(r.engine, lifespan=False) for r in self.replicas}
        self.app = PortDispatch(apps, [r.engine for r in self.replicas])

    def request_stop(self) -> None:
        self._stop.set()

    def _registry_loop(self, server: uvicorn.Server) -> None:
        """Register every replica once the server listens, heartbeat until stopped."""
        while not server.started and not self._stop.is_set():
            time.sleep(0.01)
        for r in self.replicas:
            r.agent = RegistryAgent(self.router, r.registration)
            r.agent.register()
        next_beat = time.monotonic()
        announced = False
        while not self._stop.is_set():
            for r in self.replicas:
                assert r.agent is not None
                r.agent.process_replies(0)
            if not announced and all(r.agent and r.agent.registered for r in self.replicas):
                announced = True
                self.ready.set()
                ports = [r.port for r in self.replicas]
                print(
                    f"fleet ready: {len(ports)} replicas registered with {self.router}, "
                    f"ports {ports[0]}..{ports[-1]}",
                    flush=True,
                )
            now = time.monotonic()
            if now >= next_beat:
                for r in self.replicas:
                    assert r.agent is not None
                    r.agent.heartbeat(r.engine.load())
                next_beat = now + self.heartbeat_s
            self._stop.wait(0.05)
        for r in self.replicas:
            if r.agent is not None:
                r.agent.deregister("fleet stopping", timeout_s=0.5)
                r.agent.close()
        server.should_exit = True

    def serve(self) -> None:
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=30
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=self._registry_loop, args=(server,), name="fleet-registry", daemon=True
        )
        thread.start()
        # uvicorn's own signal handling would exit before the replicas deregister.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())
        asyncio.run(server.serve(sockets=[r.sock for r in self.replicas]))
        thread.join(5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--router", required=True, help="the router's registry endpoint")
    parser.add_argument("--pool", default="")
    parser.add_argument(
        "--role",
        choices=["interactive", "batch", "prefill", "decode"],
        default="interactive",
        help="the pool's role (prefill, decode: give --kv-transfer-config too)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--advertise-host", default="")
    parser.add_argument("--heartbeat-s", type=float, default=2.0)
    parser.add_argument("--no-kv-events", action="store_true")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = sim_config(args)
        fleet = SimFleet(
            args.replicas,
            config,
            load_tokenizer(args.model or None),
            router=args.router,
            pool=args.pool,
            role=args.role,
            host=args.host,
            advertise_host=args.advertise_host,
            heartbeat_s=args.heartbeat_s,
            kv_events=not args.no_kv_events,
        )
    except (OptionsError, ValueError) as err:
        print(f"sim fleet: {err}", file=sys.stderr)
        sys.exit(2)
    print(
        f"sim fleet: {args.replicas} x {config.hardware.description}, "
        f"time scale {config.time_scale:g}",
        flush=True,
    )
    fleet.serve()


if __name__ == "__main__":
    main()
