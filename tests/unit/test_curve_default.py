"""CURVE by default, loopback included (issue 18): a config without `router.curve_dir` uses
<state_dir>/curve, whose keys the control-plane services make at start; plain sockets only
with an explicit `router.allow_plain_loopback` (or `allow_plain_remote`)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from hpcserve.config import RouterConfig, load_config
from hpcserve.contracts import protocol as p
from hpcserve.contracts.curve import KEY_FILES, CurveError, ensure_keys, generate_keys
from hpcserve.contracts.engine_token import read_token
from hpcserve.contracts.router_client import RouterQueryError, list_replicas
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.router.server import RouterServer
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.services import stop


def _write(path: Path, router: str = "") -> Path:
    path.write_text(
        f'state_dir = "state"\n\n[router]\nregistry_bind = "tcp://127.0.0.1:{free_port()}"\n'
        f'routing_bind = "tcp://127.0.0.1:{free_port()}"\nmetrics_port = {free_port()}\n' + router
    )
    return path


def test_a_config_without_curve_settings_uses_the_state_dirs_keys(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path / "a.toml"))
    assert config.router.curve_dir == str(tmp_path / "state" / "curve")
    assert not config.router.plain()
    plain = load_config(_write(tmp_path / "b.toml", "allow_plain_loopback = true\n"))
    assert plain.router.curve_dir == "" and plain.router.plain()
    remote = load_config(_write(tmp_path / "c.toml", "allow_plain_remote = true\n"))
    assert remote.router.curve_dir == "" and remote.router.plain()
    own = load_config(_write(tmp_path / "d.toml", 'curve_dir = "/site/keys"\n'))
    assert own.router.curve_dir == "/site/keys"


def test_a_router_built_without_keys_or_a_plain_choice_refuses_to_start() -> None:
    config = RouterConfig(
        registry_bind=f"tcp://127.0.0.1:{free_port()}",
        routing_bind=f"tcp://127.0.0.1:{free_port()}",
        metrics_port=0,
    )
    server = RouterServer(config, context=zmq.Context.instance())
    with pytest.raises(CurveError, match=r"router\.curve_dir .*router\.allow_plain_loopback"):
        server.bind()


def test_keys_are_made_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    state = tmp_path / "state"
    old = os.umask(0)
    try:
        assert ensure_keys(str(state / "curve"), str(state))
    finally:
        os.umask(old)
    directory = state / "curve"
    for path in (state, directory, directory / "clients", directory / "gateways"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for secret in directory.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
        assert secret.stat().st_uid == os.geteuid()
    assert all((directory / name).exists() for name in KEY_FILES)
    assert not ensure_keys(str(directory), str(state))  # once: the next start keeps them


def test_services_starting_together_agree_on_one_set_of_keys(tmp_path: Path) -> None:
    state = tmp_path / "state"
    made: list[bool] = []
    start = threading.Barrier(4)

    def service() -> None:
        start.wait()
        made.append(ensure_keys(str(state / "curve"), str(state)))

    threads = [threading.Thread(target=service) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(made) == [False, False, False, True]
    # One set: the router's public key is the one beside its secret.
    public = (state / "curve" / "router.key").read_bytes()
    assert (
        public.split(b"public-key = ")[1][:40]
        in (state / "curve" / "router.key_secret").read_bytes()
    )


def test_keys_elsewhere_are_the_sites_and_are_never_made(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert not ensure_keys(str(tmp_path / "site-keys"), str(state))
    assert not ensure_keys("", str(state))  # plain
    assert not (tmp_path / "site-keys").exists() and not state.exists()
    generate_keys(tmp_path / "partial")
    (tmp_path / "partial" / "gateway.key_secret").unlink()
    generate_keys(tmp_path / "partial")  # a missing keypair is added, the others kept


@pytest.fixture
def router_from_a_bare_config(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """`hpcserve router` from a config that says nothing about CURVE or plain."""
    path = _write(tmp_path / "hpcserve.toml")
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcserve.cli", "router", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        config = load_config(path)
        wait_for(
            "the router's /healthz",
            lambda: _healthz(config.router.metrics_port, proc, tmp_path / "router.log"),
            timeout=60,
        )
        yield path, proc
    finally:
        stop(proc)
        log.close()


def _healthz(port: int, proc: subprocess.Popen[bytes], log: Path) -> bool:
    assert proc.poll() is None, log.read_text()
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).text == "ok\n"
    except httpx.TransportError:
        return False


def test_a_router_from_a_bare_config_comes_up_authenticated(
    router_from_a_bare_config: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    path, _ = router_from_a_bare_config
    config = load_config(path)
    keys = Path(config.router.curve_dir)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert "CURVE" in (path.parent / "router.log").read_text()
    # The stack's own clients, holding the keys, are served.
    assert list_replicas(config.router.gateways_dial(), 10.0, curve_dir=str(keys)) == []
    # A client without them is not: no routing answer, no replica registered.
    with pytest.raises(RouterQueryError):
        list_replicas(config.router.gateways_dial(), 3.0)
    agent = RegistryAgent(config.router.registry_bind, p.Register("planted", "m", "http://x"))
    try:
        agent.register()
        agent.process_replies(3.0)
        assert not agent.registered
    finally:
        agent.close()
    assert list_replicas(config.router.gateways_dial(), 10.0, curve_dir=str(keys)) == []


def test_the_routers_metrics_ask_for_the_metrics_token(
    router_from_a_bare_config: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    path, _ = router_from_a_bare_config
    config = load_config(path)
    url = f"http://127.0.0.1:{config.router.metrics_port}/metrics"
    refused = httpx.get(url, timeout=10)
    assert refused.status_code == 401 and "hpcserve_router" not in refused.text
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    token = read_token(config.metrics_token_path())
    answer = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert answer.status_code == 200 and "hpcserve_router_replicas" in answer.text
    assert "hpcserve_metrics_auth_failures_total 2.0" in answer.text
