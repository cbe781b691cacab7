"""/metrics of the router, the pool manager and the batch runner, behind the metrics token.

Their series name models, pools, jobs, adapters and outcomes; another user of the host
reaches 127.0.0.1 as well as we do, so /metrics answers only a request that presents the
site's metrics token (`gateway.metrics_token_file`, the one the gateway's /metrics asks
for) as a bearer token, compared in constant time; anything else is a 401, counted in
`hpcserve_metrics_auth_failures_total`. `/healthz` stays open: it says "ok" and nothing
else. A Prometheus scrape job sends the token with `authorization: credentials_file`
(deploy/prometheus/prometheus.example.yml).
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from hpcserve.contracts.engine_token import bearer_matches

log = logging.getLogger(__name__)

_UNAUTHORIZED = (
    b'{"error":{"message":"/metrics asks for the metrics token as a bearer token (the file '
    b'gateway.metrics_token_file names)","type":"authentication_error",'
    b'"code":"invalid_metrics_token"}}'
)


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, registry: CollectorRegistry, token: str, host: str) -> None:
        if not token:
            raise ValueError("the metrics server needs a token")
        self.registry = registry
        self.token = token.encode()
        self.auth_failures = Counter(
            "hpcserve_metrics_auth_failures_total",
            "Scrapes of /metrics refused for a missing or wrong metrics token",
            registry=registry,
        )
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/healthz":
            self._reply(200, b"ok\n", "text/plain; charset=utf-8")
        elif path != "/metrics":
            self._reply(404, b"not found\n", "text/plain; charset=utf-8")
        elif not bearer_matches(self.headers.get("Authorization", ""), self.server.token):
            self.server.auth_failures.inc()
            self._reply(401, _UNAUTHORIZED, "application/json", bearer=True)
        else:
            self._reply(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)

    def do_HEAD(self) -> None:
        self.do_GET()

    def _reply(self, status: int, body: bytes, content_type: str, *, bearer: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if bearer:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds is not worth a log line


def start_metrics_server(
    port: int, registry: CollectorRegistry, token: str, host: str = "127.0.0.1"
) -> MetricsServer:
    """Serve /metrics (token) and /healthz (open) on host:port from a daemon thread."""
    server = MetricsServer(port, registry, token, host)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("/metrics on %s:%d (asks for the metrics token)", host, server.server_address[1])
    return server
