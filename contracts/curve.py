"""CURVE authentication of the router's sockets: only a holder of the cluster's engine key
can register a replica or relay KV events, only a holder of the gateway key can route.

Keys (`hpcserve keys`, written once into ``<state_dir>/curve``, secrets mode 0600)::

    curve/router.key_secret     the router's keypair (server)
    curve/router.key            its public key, which engines and gateways must know
    curve/engine.key_secret     the engines' keypair (one per cluster)
    curve/clients/engine.key    public keys the registry and KV relay sockets accept
    curve/gateway.key_secret    the gateways' keypair (gateways, batch runner, CLI queries)
    curve/gateways/gateway.key  public keys the routing socket accepts

The router's registry and KV relay ROUTER sockets are CURVE servers with a ZAP authenticator
allowing the public keys in ``clients/``; an engine's DEALERs are CURVE clients. The routing
socket speaks CURVE in our own ZMTP (contracts/zmtp_curve.py) and admits ``gateways/``.
Plain mode (no ``router.curve_dir``) is refused when any of these binds anything but
loopback, unless ``router.allow_plain_remote`` says so (a local demo on a private network).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from hpcserve.contracts.private_files import tighten


class CurveError(RuntimeError):
    pass


def generate_keys(directory: Path, *, force: bool = False) -> Path:
    """Write the router's, the engines' and the gateways' keypairs; refuse to overwrite
    unless `force`. A directory from before the gateway key gets that key added."""
    directory = Path(directory)
    have_router = (directory / "router.key_secret").exists()
    have_gateway = (directory / "gateway.key_secret").exists()
    if have_router and have_gateway and not force:
        raise CurveError(f"{directory} already holds keys (pass --force to replace them)")
    clients = directory / "clients"
    gateways = directory / "gateways"
    clients.mkdir(parents=True, exist_ok=True)
    gateways.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    if force or not have_router:
        zmq.auth.create_certificates(str(directory), "router")
        public, _ = zmq.auth.create_certificates(str(directory), "engine")
        Path(public).replace(clients / "engine.key")
    if force or not have_gateway:
        public, _ = zmq.auth.create_certificates(str(directory), "gateway")
        Path(public).replace(gateways / "gateway.key")
    for secret in directory.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return directory


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise CurveError(f"CURVE key {path} is missing (create keys with `hpcserve keys`)")
    if path.name.endswith(".key_secret"):
        tighten(path)  # owner-only, whoever loosened it (logged once)
        tighten(path.parent)
    return zmq.auth.load_certificate(str(path))


def make_server(sock: zmq.Socket, directory: Path) -> None:
    public, secret = _load(Path(directory) / "router.key_secret")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def make_client(sock: zmq.Socket, directory: Path) -> None:
    directory = Path(directory)
    public, secret = _load(directory / "engine.key_secret")
    server_public, _ = _load(directory / "router.key")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public


def start_authenticator(ctx: zmq.Context, directory: Path) -> ThreadAuthenticator:
    clients = Path(directory) / "clients"
    if not any(clients.glob("*.key")):
        raise CurveError(f"no client public keys in {clients} (create keys with `hpcserve keys`)")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(clients))
    return auth


def is_loopback_endpoint(endpoint: str) -> bool:
    """tcp://127.0.0.1:P, tcp://[::1]:P, tcp://localhost:P, ipc:// and inproc:// are local."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plain_bind(
    endpoint: str,
    curve_dir: str,
    allow_plain_remote: bool,
    setting: str = "router.registry_bind",
    what: str = "the registry",
) -> None:
    if curve_dir or allow_plain_remote or is_loopback_endpoint(endpoint):
        return
    raise CurveError(
        f"{setting} {endpoint} is not a loopback address and {what} has no "
        "authentication: set router.curve_dir (keys from `hpcserve keys`), or "
        "router.allow_plain_remote = true to accept any process that can reach it"
    )
