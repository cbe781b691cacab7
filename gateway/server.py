"""Run the gateway app under uvicorn (uvloop + httptools)."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from hpcserve.config import PlatformConfig
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.gateway.batch.service import BatchService
from hpcserve.gateway.route_hints import route_hints_for


def build_gateway_app(config: PlatformConfig):  # type: ignore[no-untyped-def]
    gateway = Gateway(
        config.gateway,
        routing_endpoint=config.router.gateways_dial(),
        configured_models={pool.model for pool in config.pools},
        batch=BatchService(config.batch, Path(config.batch_dir())),
    )
    gateway.route_hints = route_hints_for(config)
    return build_app(gateway)


def run_gateway(config: PlatformConfig) -> None:
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
        )
    )
    server.run()
