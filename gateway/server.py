"""Run the gateway app under uvicorn (uvloop + httptools), with TLS when configured."""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import uvicorn

from hpcserve.config import ConfigError, GatewayConfig, PlatformConfig
from hpcserve.contracts.curve import ensure_keys
from hpcserve.contracts.engine_token import ensure_token
from hpcserve.contracts.private_files import private_dir
from hpcserve.contracts.zmtp_curve import routing_client_keys
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.gateway.batch.service import BatchService
from hpcserve.gateway.embedded_router import EmbeddableRouter, EmbeddedRouting
from hpcserve.gateway.gc_tune import tune_gc
from hpcserve.gateway.http_protocol import OneSendHttpProtocol
from hpcserve.gateway.route_hints import register_cache_metrics, route_hints_for
from hpcserve.gateway.workers import (
    WorkerSet,
    private_socket,
    reuseport_socket,
    run_workers,
    worker_address,
)

log = logging.getLogger(__name__)


# `gateway.embed_router`: config -> the router this process runs, bound (`hpcserve gateway`
# passes hpcserve/cli.py's; the gateway does not import the router). Raises ConfigError.
RouterFactory = Callable[[PlatformConfig], EmbeddableRouter]


def build_gateway_app(  # type: ignore[no-untyped-def]
    config: PlatformConfig,
    workers: WorkerSet | None = None,
    router_factory: RouterFactory | None = None,
):
    private_dir(config.state_dir)
    ensure_keys(config.router.curve_dir, config.state_dir)  # <state_dir>/curve's, if absent
    routing = None
    if config.gateway.embed_router and (workers is None or workers.index == 0):
        if router_factory is None:
            raise ConfigError("gateway.embed_router: no router to embed (run `hpcserve gateway`)")
        # The other workers dial its routing socket, as they would `hpcserve router`'s.
        routing = EmbeddedRouting(
            router_factory(config),
            view_refresh_s=config.gateway.replica_view_s,
            view_max_age_s=config.gateway.replica_view_max_age_s,
        )
    gateway = Gateway(
        msgspec.structs.replace(
            config.gateway, responses_dir=config.responses_dir(), usage_dir=config.usage_dir()
        ),
        routing_endpoint=config.router.gateways_dial(),
        routing_keys=routing_client_keys(config.router.curve_dir),
        routing=routing,
        configured_models={pool.model for pool in config.pools},
        batch=BatchService(config.batch, Path(config.batch_dir())),
        engine_token=ensure_token(config.engine_token_path()),
        metrics_token=ensure_token(config.metrics_token_path()),
    )
    gateway.route_hints = route_hints_for(config)
    register_cache_metrics(gateway.metrics_registry, gateway.route_hints)
    gateway.messages_refused = {pool.model for pool in config.pools if not pool.messages_api}
    gateway.wake_budgets = {
        pool.model: pool.autoscale.wake_budget_s
        for pool in config.pools
        if pool.autoscale is not None and pool.autoscale.min == 0
    }
    gateway.wake_versions = wake_versions(config)
    if gateway.wake_versions or any(
        p.autoscale and p.autoscale.min == 0 and p.model_ref for p in config.pools
    ):
        gateway.wake_versions_source = lambda: wake_versions(config)
    gateway.workers = workers
    return build_app(gateway)


def wake_versions(config: PlatformConfig) -> dict[str, str]:
    """Registry version (name@version) -> the served name of the pool that may scale to zero
    (autoscale.min = 0) serving it, for pools with a model_ref: a request for an alias or a
    LoRA adapter of that version is held while the pool wakes, as one for its served name is
    (RouteReply.model_ref names the version). Read at start, and again (at most every
    WAKE_VERSIONS_REREAD_S) when a request's version is not in it: a model_ref naming an
    alias or a bare model follows a promote or a new version. A registry that cannot be
    read: {} (logged), and such requests get 503 at once."""
    pools = [p for p in config.pools if p.autoscale and p.autoscale.min == 0 and p.model_ref]
    path = Path(config.registry_path())
    if not pools or not path.exists():
        return {}
    import sqlite3

    from hpcserve.modelcache.registry import Registry, RegistryError

    out: dict[str, str] = {}
    try:
        with Registry(path) as registry:
            for pool in pools:
                try:
                    out[registry.version(pool.model_ref).ref] = pool.model
                except RegistryError as err:
                    log.warning(
                        "pool %s: requests for its aliases and adapters are not held while it "
                        "wakes: %s",
                        pool.name,
                        err,
                    )
    except (OSError, sqlite3.Error) as err:
        log.warning("cannot read the model registry %s: requests for the aliases and adapters "
                    "of pools at zero are not held: %s", path, err)  # fmt: skip
    return out


def tls_settings(gateway: GatewayConfig) -> dict[str, Any]:
    """uvicorn's TLS settings ({} without TLS), the files checked first: they exist and load
    as a certificate chain and its private key. Raises ConfigError naming the key."""
    cert, key = gateway.tls_cert, gateway.tls_key
    if not cert:
        return {}
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not os.path.isfile(path):
            raise ConfigError(f"gateway.{name}: {path!r} is not a readable file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as err:
        raise ConfigError(
            f"gateway.tls_cert, gateway.tls_key: {cert!r} and {key!r} do not load as a "
            f"certificate chain and its private key: {err}"
        ) from None
    mode = os.stat(key).st_mode & 0o777
    if mode & 0o077:
        log.warning("gateway.tls_key %s is mode %04o: others on this host may read it", key, mode)
    log.info("TLS on: certificate %s", cert)
    return {"ssl_certfile": cert, "ssl_keyfile": key}


def run_gateway(config: PlatformConfig, router_factory: RouterFactory | None = None) -> int:
    """Serve until stopped: in this process, or with `gateway.workers` > 1 in that many
    worker processes sharing the port (gateway/workers.py). Returns the exit status.
    router_factory: the router to embed (`gateway.embed_router`; in worker 0)."""
    workers = config.gateway.workers
    if workers <= 1:
        _serve(config, None, [], router_factory)
        return 0
    tls_settings(config.gateway)  # a bad certificate is refused here, not by each worker
    # Made once here, not by every worker at the same moment (each would write its own).
    private_dir(config.state_dir)
    ensure_keys(config.router.curve_dir, config.state_dir)
    ensure_token(config.engine_token_path())
    ensure_token(config.metrics_token_path())
    return run_workers(
        workers, config.gateway.host, config.gateway.port, _worker, (config, router_factory)
    )


def _worker(config: PlatformConfig, router_factory: RouterFactory | None, index: int) -> None:
    """One worker process (spawned): its own logging, its own SO_REUSEPORT socket, and its
    private socket where the others gather its metrics."""
    from hpcserve.logs import setup_logging

    setup_logging(f"gateway-{index}")
    gw = config.gateway
    addresses = [worker_address(config.state_dir, gw.host, gw.port, i) for i in range(gw.workers)]
    sockets = [reuseport_socket(gw.host, gw.port), private_socket(addresses[index])]
    _serve(config, WorkerSet(index, addresses, tls=bool(gw.tls_cert)), sockets, router_factory)


def _serve(
    config: PlatformConfig,
    workers: WorkerSet | None,
    sockets: list[socket.socket],
    router_factory: RouterFactory | None = None,
) -> None:
    tls = tls_settings(config.gateway)
    server = uvicorn.Server(
        uvicorn.Config(
            build_gateway_app(config, workers, router_factory),
            host=config.gateway.host,
            port=config.gateway.port,
            loop="uvloop",
            http=OneSendHttpProtocol,  # httptools, each answer in one send
            lifespan="on",
            access_log=False,
            # X-Forwarded-For is not used: one ASGI layer less per request.
            proxy_headers=False,
            log_config=None,
            timeout_graceful_shutdown=30,
            **tls,
        )
    )
    tune_gc()  # after the app is built: its long-lived objects are frozen
    server.run(sockets=sockets or None)
