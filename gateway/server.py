"""Run the gateway app under uvicorn (uvloop + httptools), with TLS when configured."""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path
from typing import Any

import msgspec
import uvicorn

from hpcserve.config import ConfigError, GatewayConfig, PlatformConfig
from hpcserve.contracts.engine_token import ensure_token
from hpcserve.contracts.private_files import private_dir
from hpcserve.contracts.zmtp_curve import routing_client_keys
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.gateway.batch.service import BatchService
from hpcserve.gateway.route_hints import route_hints_for

log = logging.getLogger(__name__)


def build_gateway_app(config: PlatformConfig):  # type: ignore[no-untyped-def]
    private_dir(config.state_dir)
    gateway = Gateway(
        msgspec.structs.replace(config.gateway, responses_dir=config.responses_dir()),
        routing_endpoint=config.router.gateways_dial(),
        routing_keys=routing_client_keys(config.router.curve_dir),
        configured_models={pool.model for pool in config.pools},
        batch=BatchService(config.batch, Path(config.batch_dir())),
        engine_token=ensure_token(config.engine_token_path()),
        metrics_token=ensure_token(config.metrics_token_path()),
    )
    gateway.route_hints = route_hints_for(config)
    gateway.messages_refused = {pool.model for pool in config.pools if not pool.messages_api}
    return build_app(gateway)


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


def run_gateway(config: PlatformConfig) -> None:
    tls = tls_settings(config.gateway)
    server = uvicorn.Server(
        uvicorn.Config(
            build_gateway_app(config),
            host=config.gateway.host,
            port=config.gateway.port,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            # X-Forwarded-For is not used: one ASGI layer less per request.
            proxy_headers=False,
            log_config=None,
            timeout_graceful_shutdown=30,
            **tls,
        )
    )
    server.run()
