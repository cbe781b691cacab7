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

CURVE is the default, loopback included (another user of the host reaches 127.0.0.1 too):
a config without ``router.curve_dir`` uses ``<state_dir>/curve`` (hpcserve/config.py), and
the control-plane services (router, gateway, batch runner, pool manager) make its keys at
their start when it holds none (`ensure_keys`, under a lock, so services starting together
agree on one set). Keys anywhere else are the site's to make (`hpcserve keys --dir`); a
missing one is an error naming it. Engines never make keys. Plain mode needs an explicit
``router.allow_plain_loopback`` (loopback binds only) or ``router.allow_plain_remote`` (any
bind, a local demo on a private network).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from hpcserve.contracts.private_files import private_dir, private_opener, tighten

log = logging.getLogger(__name__)

# The keypairs a complete key directory holds (public halves beside their secrets).
KEY_FILES = (
    "router.key",
    "router.key_secret",
    "engine.key_secret",
    "clients/engine.key",
    "gateway.key_secret",
    "gateways/gateway.key",
)


class CurveError(RuntimeError):
    pass


def generate_keys(directory: Path, *, force: bool = False) -> Path:
    """Write the router's, the engines' and the gateways' keypairs; refuse to overwrite
    unless `force`. A directory from before the gateway key gets that key added."""
    directory = Path(directory)
    have_router = all(
        (directory / name).exists()
        for name in ("router.key", "router.key_secret", "engine.key_secret", "clients/engine.key")
    )
    have_gateway = all(
        (directory / name).exists() for name in ("gateway.key_secret", "gateways/gateway.key")
    )
    if have_router and have_gateway and not force:
        raise CurveError(f"{directory} already holds keys (pass --force to replace them)")
    # Owner-only before the first key is written (zmq writes secrets with the umask's mode).
    private_dir(directory)
    clients = private_dir(directory / "clients")
    gateways = private_dir(directory / "gateways")
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


def default_keys_dir(state_dir: str) -> str:
    """Where the keys are when the config names no `router.curve_dir`."""
    return str(Path(state_dir) / "curve")


def ensure_keys(curve_dir: str, state_dir: str) -> bool:
    """Make the keys of `<state_dir>/curve` when it lacks any (True if it made some): the
    control-plane services call this at start, so a site turns nothing on for CURVE. Several
    starting at once agree on one set (an exclusive lock around the check and the write).
    Another directory, or plain mode (""), is left alone: its keys are the site's."""
    if not curve_dir or Path(curve_dir).absolute() != Path(default_keys_dir(state_dir)).absolute():
        return False
    directory = Path(curve_dir)
    if all((directory / name).exists() for name in KEY_FILES):
        return False
    private_dir(directory.parent)
    private_dir(directory)
    with open(directory / ".lock", "a+", opener=private_opener) as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if all((directory / name).exists() for name in KEY_FILES):
                return False  # another service made them meanwhile
            generate_keys(directory)
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    log.info(
        "made the CURVE keys in %s (router, engine and gateway keypairs; secrets mode 0600 "
        "in a 0700 directory)",
        directory,
    )
    return True


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise CurveError(
            f"CURVE key {path} is missing (the router, gateway, batch runner and pool manager "
            "make <state_dir>/curve's keys at start; for another router.curve_dir run "
            "`hpcserve keys --dir DIR`)"
        )
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


def check_plain_allowed(
    curve_dir: str, allow_plain_loopback: bool, allow_plain_remote: bool
) -> None:
    """Plain sockets only when the config says so: no key directory is not enough (a config
    loaded from a file gets `<state_dir>/curve` then; one built in code must choose)."""
    if curve_dir or allow_plain_loopback or allow_plain_remote:
        return
    raise CurveError(
        "router.curve_dir is empty and plain sockets were not asked for: set router.curve_dir "
        "(keys from `hpcserve keys`), or router.allow_plain_loopback = true to accept any "
        "process of this host on the loopback binds"
    )


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
