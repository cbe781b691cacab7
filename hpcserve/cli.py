"""`hpcserve`: one console script, a subcommand per component."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpcserve.config import (
    DEFAULT_STATE_DIR,
    ConfigError,
    PlatformConfig,
    config_path,
    load_config,
)
from hpcserve.contracts.engine_args import KV_TRANSFER_MAX_MB, KV_TRANSFER_TTL_S

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from hpcserve.router.server import RouterServer


def _load(args: argparse.Namespace) -> PlatformConfig:
    return load_config(config_path(args.config))


def _start_metrics(port: int, registry: CollectorRegistry, cfg: PlatformConfig) -> None:
    """/metrics on 127.0.0.1:port behind the metrics token (contracts/metrics_http.py)."""
    if port:
        from hpcserve.contracts.engine_token import ensure_token
        from hpcserve.contracts.metrics_http import start_metrics_server

        start_metrics_server(port, registry, ensure_token(cfg.metrics_token_path()))


def cmd_router(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from hpcserve.contracts.curve import ensure_keys
    from hpcserve.router.server import router_for

    cfg = _load(args)
    registry = CollectorRegistry()
    server = router_for(cfg, registry)
    try:
        ensure_keys(cfg.router.curve_dir, cfg.state_dir)  # <state_dir>/curve's, if absent
        server.bind()
    except (RuntimeError, OSError) as err:  # a port in use, plain on a public address, keys
        print(f"hpcserve router: {err}", file=sys.stderr)
        return 2
    _start_metrics(cfg.router.metrics_port, registry, cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    server.serve_forever()
    return 0


def embedded_router(cfg: PlatformConfig) -> RouterServer:
    """The router a gateway with `gateway.embed_router` runs in its process: what `hpcserve
    router` runs, bound, with its /metrics on router.metrics_port. Raises ConfigError."""
    from prometheus_client import CollectorRegistry

    from hpcserve.router.server import router_for

    registry = CollectorRegistry()
    server = router_for(cfg, registry)
    try:
        server.bind()
    except (RuntimeError, OSError) as err:  # a port in use, plain on a public address, keys
        raise ConfigError(f"gateway.embed_router: the router cannot start: {err}") from None
    _start_metrics(cfg.router.metrics_port, registry, cfg)
    return server


def cmd_gateway(args: argparse.Namespace) -> int:
    import msgspec

    from hpcserve.gateway.server import run_gateway

    cfg = _load(args)
    if args.port is not None:  # several gateways on one host: hpcserve-gateway@PORT.service
        cfg = msgspec.structs.replace(
            cfg, gateway=msgspec.structs.replace(cfg.gateway, port=args.port)
        )
    if args.workers is not None:  # processes sharing the port (gateway/workers.py)
        cfg = msgspec.structs.replace(
            cfg, gateway=msgspec.structs.replace(cfg.gateway, workers=args.workers)
        )
    return run_gateway(cfg, embedded_router if cfg.gateway.embed_router else None)


def cmd_batch_runner(args: argparse.Namespace) -> int:
    from hpcserve.gateway.batch.process import run_batch_runner

    return run_batch_runner(_load(args))


def cmd_poolmgr(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from hpcserve.poolmgr.launchers import LocalLauncher, make_launcher
    from hpcserve.poolmgr.manager import PoolManager
    from hpcserve.poolmgr.render import render
    from hpcserve.poolmgr.spec import build_job_spec

    cfg = _load(args)
    if args.check:
        print(f"config {config_path(args.config)} is valid")
        for pool in cfg.pools:
            size = f"{pool.replicas}..{pool.max_replicas}" if pool.max_replicas else pool.replicas
            print(
                f"pool {pool.name} ({pool.role}): model {pool.model} from {pool.model_path}, "
                f"{size} replica(s) x {pool.nodes_per_replica} node(s) x "
                f"{pool.gpus_per_replica} GPU(s), "
                f"TP={pool.tensor_parallel} PP={pool.pipeline_parallel}, engine {pool.engine}"
            )
        if cfg.pools and args.show_script:
            print(render(build_job_spec(cfg, cfg.pools[0])))
        return 0
    from hpcserve.poolmgr.single import EXIT_HELD, PoolMgrLock, PoolMgrLockHeld

    # One pool manager per state dir, held for this process's life (poolmgr/single.py).
    lock = PoolMgrLock(Path(cfg.state_dir))
    try:
        lock.acquire()
    except PoolMgrLockHeld as err:
        print(f"hpcserve poolmgr: {err}", file=sys.stderr)
        return EXIT_HELD
    from hpcserve.contracts.curve import ensure_keys

    ensure_keys(cfg.router.curve_dir, cfg.state_dir)  # <state_dir>/curve's, if absent
    registry = CollectorRegistry()
    launcher = make_launcher(cfg)
    manager = PoolManager(
        cfg, launcher, config_path=config_path(args.config), metrics_registry=registry
    )
    _start_metrics(cfg.poolmgr.metrics_port, registry, cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: manager.stop())
    signal.signal(signal.SIGHUP, lambda *_: manager.request_reload())
    try:
        manager.run_forever()
    finally:
        if isinstance(launcher, LocalLauncher):
            launcher.shutdown(timeout_s=cfg.slurm.drain_s + 15)
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from hpcserve.engine_launch.engine import EngineOptions, EngineRunner
    from hpcserve.engine_launch.topology import TopologyError

    extra = list(args.engine_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    options = EngineOptions(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        router=args.router,
        pool=args.pool,
        engine=args.engine,
        python=args.python,
        bind_host=args.bind_host,
        advertise_host=args.advertise_host,
        port=args.port,
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        heartbeat_s=args.heartbeat_s,
        ready_timeout_s=args.ready_timeout_s,
        drain_s=args.drain_s,
        cache_dir=args.cache_dir,
        manifest=args.manifest,
        model_ref=args.model_ref,
        extra_args=tuple(extra),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        head_port=args.head_port,
        drain_file=args.drain_file,
        lora_plan=args.lora_plan,
        curve_dir=args.curve_dir,
        role=args.role,
        engine_token_file=args.engine_token_file,
        canary_record=args.canary_record,
        kv_transfer_ttl_s=args.kv_transfer_ttl_s,
        kv_transfer_max_mb=args.kv_transfer_max_mb,
        private_network=args.private_network,
    )
    try:
        runner = EngineRunner(options)
    except TopologyError as err:
        print(f"hpcserve engine: {err}", file=sys.stderr)
        return 2
    return runner.run()


def cmd_free_ports(args: argparse.Namespace) -> int:
    """N distinct TCP ports free on this host now (for job scripts). With --hold-for PID they
    stay reserved for that process (the job's shell) until it exits, so no other hpcserve
    process on the host hands them out; a foreign process may still take one, so scripts let
    an admin set their own."""
    from hpcserve.ports import free_ports, reserve_ports

    if not args.hold_for:
        print(" ".join(str(port) for port in free_ports(args.count)))
        return 0
    reservations = reserve_ports(args.count)
    try:
        for reservation in reservations:
            reservation.hand_over(args.hold_for)
    except ValueError as err:
        for reservation in reservations:
            reservation.release()
        print(f"hpcserve free-ports: {err}", file=sys.stderr)
        return 2
    print(" ".join(str(r.port) for r in reservations))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from hpcserve.stack import Stack

    return Stack(Path(args.state_dir), config_path=args.config, slurm_port=args.slurm_port).up(
        launcher=args.launcher, timeout_s=args.timeout
    )


def cmd_down(args: argparse.Namespace) -> int:
    from hpcserve.stack import Stack

    return Stack(Path(args.state_dir), config_path=args.config, slurm_port=args.slurm_port).down()


def cmd_status(args: argparse.Namespace) -> int:
    from hpcserve.status import collect_status, format_status

    status = collect_status(_load(args))
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from hpcserve.poolmgr.state_files import write_override

    cfg = _load(args)
    pool = cfg.pool(args.pool)
    if args.replicas is None and not args.reset:
        print("hpcserve scale: give a replica count or --reset", file=sys.stderr)
        return 2
    if args.replicas is not None and args.replicas < 0:
        print(f"hpcserve scale: replicas must be >= 0, got {args.replicas}", file=sys.stderr)
        return 2
    write_override(Path(cfg.state_dir), pool.name, None if args.reset else args.replicas)
    target = pool.replicas if args.reset else args.replicas
    if pool.autoscale is not None:
        print(
            f"pool {pool.name}: "
            + (
                "autoscaling resumes"
                if args.reset
                else f"desired replicas {target}; autoscaling paused until --reset"
            )
            + "; the pool manager applies it at its next poll"
        )
        return 0
    print(
        f"pool {pool.name}: desired replicas {target}"
        + (" (back to the config's value)" if args.reset else "")
        + "; the pool manager applies it at its next poll"
    )
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from hpcserve.contracts.curve import CurveError, generate_keys

    directory = Path(args.dir) if args.dir else Path(_load(args).state_dir) / "curve"
    try:
        generate_keys(directory, force=args.force)
    except CurveError as err:
        print(f"hpcserve keys: {err}", file=sys.stderr)
        return 1
    print(f"CURVE keys written to {directory}")
    if not args.dir:
        print("the router's sockets use them (router.curve_dir's default, <state_dir>/curve)")
    else:
        print("if they are not <state_dir>/curve, point the config at them with")
        print(f'  [router]\n  curve_dir = "{directory.resolve()}"')
    return 0


def cmd_install_units(args: argparse.Namespace) -> int:
    from hpcserve.units import (
        UnitError,
        UnitSettings,
        default_prefix,
        install_units,
        writable_paths,
    )

    path = config_path(args.config).resolve()
    cfg = load_config(path)
    settings = UnitSettings(
        prefix=args.prefix or default_prefix(),
        config=str(path),
        user=args.user,
        group=args.group,
        writable=writable_paths(cfg),
        gateway_ports=tuple(args.gateway_port or [cfg.gateway.port]),
    )
    try:
        written = install_units(Path(args.dest), settings)
    except (UnitError, OSError) as err:
        print(f"hpcserve install-units: {err}", file=sys.stderr)
        return 2
    for unit in written:
        print(f"wrote {unit}")
    print(
        f"as {settings.user}, writing only {' '.join(settings.writable)}; then:\n"
        "  systemctl daemon-reload && systemctl enable --now hpcserve.target"
    )
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    from hpcserve.poolmgr.single import holder_pid, lock_path

    cfg = _load(args)  # a config that does not validate is refused here, before any signal
    pid_file = Path(cfg.state_dir) / "run" / "poolmgr.pid"  # `hpcserve up` writes it
    try:
        # A pool manager under systemd is found by its lock (`systemctl reload` works too).
        held = holder_pid(Path(cfg.state_dir))
        if held is None and not pid_file.exists():
            pid_file = lock_path(Path(cfg.state_dir))
        pid = held if held is not None else int(pid_file.read_text())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError) as err:
        print(
            f"hpcserve reload: no running pool manager found via {pid_file}: {err}", file=sys.stderr
        )
        return 1
    print(f"config valid; pool manager (pid {pid}) reloads it at its next poll")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from hpcserve.poolmgr.launchers import make_launcher
    from hpcserve.slurm.client import SlurmError

    client = make_launcher(_load(args))
    try:
        if args.command == "drain-node":
            client.drain_node(args.node, args.reason)
            print(f"node {args.node} draining: {args.reason}")
        else:
            client.resume_node(args.node)
            print(f"node {args.node} resumed")
    except SlurmError as err:
        print(f"hpcserve {args.command}: {err}", file=sys.stderr)
        return 1
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from hpcserve.tinymodels import make_tiny_model

    out = make_tiny_model(
        args.kind,
        Path(args.dir),
        seed=args.seed,
        size=args.size,
        progress=lambda line: print(line, file=sys.stderr),
        dtype=args.dtype,
        perturb=args.perturb,
    )
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--config",
            help="platform config (TOML); default $HPCSERVE_CONFIG "
            f"or {DEFAULT_STATE_DIR}/hpcserve.toml",
        )
        return p

    with_config(sub.add_parser("router", help="run the router")).set_defaults(func=cmd_router)
    p = with_config(
        sub.add_parser(
            "keys", help="create CURVE keys for the router's sockets (registry, KV relay, routing)"
        )
    )
    p.add_argument("--dir", default="", help="where (default: <state_dir>/curve)")
    p.add_argument("--force", action="store_true", help="replace existing keys")
    p.set_defaults(func=cmd_keys)
    p = with_config(sub.add_parser("gateway", help="run the OpenAI-compatible gateway"))
    p.add_argument(
        "--port",
        type=int,
        choices=range(1, 65536),
        metavar="PORT",
        help="listen here instead of gateway.port (several gateways on one host)",
    )
    p.add_argument(
        "--workers",
        type=int,
        choices=range(1, 513),
        metavar="N",
        help="worker processes sharing the port with SO_REUSEPORT, one per core to use "
        "(instead of gateway.workers)",
    )
    p.set_defaults(func=cmd_gateway)
    with_config(
        sub.add_parser("batch-runner", help="run the Batch API's batches (a process of its own)")
    ).set_defaults(func=cmd_batch_runner)
    p = with_config(sub.add_parser("poolmgr", help="run the pool manager"))
    p.add_argument("--check", action="store_true", help="validate the config, print the plan")
    p.add_argument(
        "--show-script",
        action="store_true",
        help="with --check: print the sbatch script of the first pool",
    )
    p.set_defaults(func=cmd_poolmgr)

    p = sub.add_parser("engine", help="run one replica (inside a Slurm job)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--router", required=True, help="router registry endpoint, tcp://host:port")
    p.add_argument("--pool", default="")
    p.add_argument("--engine", choices=["vllm", "vllm-cpu", "sim"], default="vllm")
    p.add_argument("--python", default="", help="interpreter that has vLLM (default: this one)")
    p.add_argument("--bind-host", default="0.0.0.0")
    p.add_argument("--advertise-host", default="", help="host gateways use (default: hostname)")
    p.add_argument("--port", type=int, default=0, help="vLLM port (default: a free one)")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--pipeline-parallel", type=int, default=1)
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--drain-s", type=int, default=30)
    p.add_argument("--cache-dir", default="", help="node-local cache to stage the model into")
    p.add_argument("--manifest", default="", help="digest manifest of the model (JSON)")
    p.add_argument("--model-ref", default="", help="registry name@version of the model")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of this replica (one engine each)")
    p.add_argument(
        "--node-rank", type=int, default=-1, help="this node's rank (default: SLURM_NODEID)"
    )
    p.add_argument("--master-addr", default="", help="multi-node: the head node's address")
    p.add_argument("--master-port", type=int, default=0, help="multi-node: torch.distributed")
    p.add_argument(
        "--head-port", type=int, default=0, help="multi-node: rank 0's engine, for the others"
    )
    p.add_argument("--drain-file", default="", help="drain when this file appears")
    p.add_argument(
        "--lora-plan",
        default=os.environ.get("HPCSERVE_LORA_PLAN", ""),
        help="LoRA: the pool's adapter plan, JSON (default: $HPCSERVE_LORA_PLAN)",
    )
    p.add_argument(
        "--curve-dir",
        default=os.environ.get("HPCSERVE_CURVE_DIR", ""),
        help="CURVE keys for the registry and KV relay sockets (default: $HPCSERVE_CURVE_DIR; "
        "empty: plain)",
    )
    p.add_argument(
        "--engine-token-file",
        default=os.environ.get("HPCSERVE_ENGINE_TOKEN_FILE", ""),
        help="the engine token vLLM requires of its callers (default: "
        "$HPCSERVE_ENGINE_TOKEN_FILE; empty: vLLM answers anyone)",
    )
    p.add_argument(
        "--canary-record",
        default=os.environ.get("HPCSERVE_CANARY_RECORD", ""),
        help="the version's golden record (numerical canaries), checked before registering "
        "and periodically; it may appear later (default: $HPCSERVE_CANARY_RECORD; empty: none)",
    )
    p.add_argument(
        "--private-network",
        choices=["auto", "required", "off"],
        default=os.environ.get("HPCSERVE_PRIVATE_NETWORK", "auto"),
        help="vLLM in a network namespace of its own, its workers' listeners closed to the "
        "node's other users: where the kernel allows it (auto), or not at all without it "
        "(required) (default: $HPCSERVE_PRIVATE_NETWORK or auto)",
    )
    p.add_argument(
        "--role",
        choices=["interactive", "batch", "prefill", "decode"],
        default=os.environ.get("HPCSERVE_POOL_ROLE", "interactive"),
        help="the pool's role, told to the router (default: $HPCSERVE_POOL_ROLE or interactive)",
    )
    p.add_argument(
        "--kv-transfer-ttl-s",
        type=float,
        default=float(os.environ.get("HPCSERVE_KV_TRANSFER_TTL_S", KV_TRANSFER_TTL_S)),
        help="a prefill or decode engine on the storage connector removes its directory's "
        "entries this long after they were written (default: $HPCSERVE_KV_TRANSFER_TTL_S "
        f"or {KV_TRANSFER_TTL_S:g})",
    )
    p.add_argument(
        "--kv-transfer-max-mb",
        type=int,
        default=int(os.environ.get("HPCSERVE_KV_TRANSFER_MAX_MB", KV_TRANSFER_MAX_MB)),
        help="... and the oldest while the directory holds more than this (default: "
        f"$HPCSERVE_KV_TRANSFER_MAX_MB or {KV_TRANSFER_MAX_MB})",
    )
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: extra vLLM arguments")
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("free-ports", help="print N free TCP ports of this host (job scripts)")
    p.add_argument("count", type=int, nargs="?", default=1)
    p.add_argument(
        "--hold-for",
        type=int,
        default=0,
        metavar="PID",
        help="keep the ports reserved on this host until process PID exits (the job's shell)",
    )
    p.set_defaults(func=cmd_free_ports)

    for name, func, text in (
        ("up", cmd_up, "start the whole stack (local demo cluster)"),
        ("down", cmd_down, "stop everything `up` started"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
        p.add_argument("--config", help="use this platform config instead of the demo one")
        p.add_argument(
            "--slurm-port",
            type=int,
            default=16817,
            help="slurmctld port of the local cluster (slurmds use the next ports)",
        )
        if name == "up":
            p.add_argument(
                "--launcher",
                choices=["slurm", "local"],
                default=None,
                help="slurm (default where Slurm can run) or local processes",
            )
            p.add_argument(
                "--timeout", type=float, default=900.0, help="seconds to wait for the first replica"
            )
        p.set_defaults(func=func)

    p = with_config(sub.add_parser("status", help="pools, jobs and replicas"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = with_config(sub.add_parser("scale", help="set a pool's desired replicas"))
    p.add_argument("pool")
    p.add_argument("replicas", type=int, nargs="?")
    p.add_argument("--reset", action="store_true", help="back to the config's replicas")
    p.set_defaults(func=cmd_scale)
    with_config(
        sub.add_parser("reload", help="validate the config, make the pool manager apply it")
    ).set_defaults(func=cmd_reload)
    p = with_config(
        sub.add_parser("install-units", help="write systemd units for this config (deploy/)")
    )
    p.add_argument("--user", default="hpcserve", help="the service account (default hpcserve)")
    p.add_argument("--group", default="", help="its group (default: the user's name)")
    p.add_argument("--prefix", default="", help="the venv to run (default: this one)")
    p.add_argument("--dest", default="/etc/systemd/system", help="where to write the units")
    p.add_argument(
        "--gateway-port",
        type=int,
        action="append",
        help="a gateway instance hpcserve.target starts (repeat; default gateway.port)",
    )
    p.set_defaults(func=cmd_install_units)
    p = with_config(sub.add_parser("drain-node", help="drain a node in Slurm with a reason"))
    p.add_argument("node")
    p.add_argument("--reason", required=True)
    p.set_defaults(func=cmd_node)
    p = with_config(sub.add_parser("resume-node", help="return a drained node to service"))
    p.add_argument("node")
    p.set_defaults(func=cmd_node)

    from hpcserve.planner.cli import add_plan_parser

    add_plan_parser(sub)

    from hpcserve.health.cli import add_health_parser

    add_health_parser(sub)

    from hpcserve.doctor.cli import add_doctor_parser

    add_doctor_parser(sub)

    from hpcserve.poolmgr.rollout_cli import add_rollout_parser

    add_rollout_parser(sub, with_config)

    models = sub.add_parser("models", help="model tools")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="COMMAND")
    p = msub.add_parser("make-tiny", help="write a tiny random-weight HF model directory")
    p.add_argument("--kind", choices=["chat", "embed", "rerank", "lora"], required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=["tiny", "small"], default="tiny")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16"],
        default="float32",
        help="chat: the weights' stored dtype (float16: the same weights, rounded)",
    )
    p.add_argument(
        "--perturb",
        type=float,
        default=0.0,
        metavar="SCALE",
        help="chat: add seeded noise of SCALE x each matrix's std (a corrupted variant)",
    )
    p.add_argument("dir")
    p.set_defaults(func=cmd_make_tiny)

    from hpcserve.modelcache.cli import add_cache_parser, add_models_registry_parsers

    add_models_registry_parsers(msub)
    add_cache_parser(sub)

    from hpcserve.onboarding.cli import add_eval_parser

    add_eval_parser(msub)  # models eval REF --suite FILE [--baseline REF]

    from hpcserve.gateway.batch.progress import add_batches_parser

    add_batches_parser(sub, with_config)

    from hpcserve.report.cli import add_report_parser

    add_report_parser(sub, with_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hpcserve.logs import setup_logging

    setup_logging(args.command)
    try:
        return int(args.func(args))
    except ConfigError as err:
        print(f"hpcserve {args.command}: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
