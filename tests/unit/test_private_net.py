"""vLLM in a network namespace of its own (engine_launch/private_net.py), on the HTTP socket
the engine made (engine_launch/vllm_api.py): real namespaces, real sockets, as root and as
an unprivileged user (through a user namespace), and where the kernel refuses."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcserve.engine_launch import private_net
from hpcserve.engine_launch.engine import EngineFailed, EngineOptions, EngineRunner
from hpcserve.engine_launch.vllm_api import adopted_socket
from tests.ports import free_port
from tests.unprivileged import probe_python, probe_user, run_as

ENGINE_LAUNCH = Path(private_net.__file__).parent

# Listens on 127.0.0.1:PORT where it runs, proves its loopback works by connecting to
# itself, prints what it is, and keeps listening until its stdin closes.
LISTENER = """
import json, os, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
print(json.dumps({"netns": os.readlink("/proc/self/ns/net"), "uid": os.getuid(),
                  "gid": os.getgid()}), flush=True)
sys.stdin.read()
"""


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@contextlib.contextmanager
def _running(argv: list[str]) -> Iterator[tuple[subprocess.Popen[str], dict[str, object]]]:
    child = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.communicate(timeout=30)[1]
        yield child, json.loads(line)
    finally:
        child.communicate(timeout=30)


def test_as_root_the_command_listens_where_nobody_else_reaches() -> None:
    port = free_port()
    argv = [sys.executable, "-m", "hpcserve.engine_launch.private_net", "--required", "--",
            sys.executable, "-c", LISTENER, str(port)]  # fmt: skip
    with _running(argv) as (child, seen):
        assert seen["netns"] != os.readlink("/proc/self/ns/net")
        assert seen["uid"] == os.getuid()
        assert _refused(port)  # its listener is not on the node's loopback
    assert child.returncode == 0


def test_an_unprivileged_account_gets_it_through_a_user_namespace_of_its_own() -> None:
    """The service account need not be root: its uid and gid map to themselves."""
    user = probe_user()
    port = free_port()
    python = probe_python()
    argv = ["runuser", "-u", user.name, "--", python, str(ENGINE_LAUNCH / "private_net.py"),
            "--required", "--", python, "-c", LISTENER, str(port)]  # fmt: skip
    with _running(argv) as (child, seen):
        assert seen["netns"] != os.readlink("/proc/self/ns/net")
        assert (seen["uid"], seen["gid"]) == (user.uid, user.gid)
        assert _refused(port)
        # ... nor on the loopback the probe user itself is on
        probe = run_as(
            [python, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}))"]
        )
        assert "ConnectionRefusedError" in probe.stderr
    assert child.returncode == 0


# private_net's main in a process that already runs a second thread: the kernel refuses a
# multithreaded process a user namespace (EINVAL), as a site's sysctl would (ENOSPC).
THREADED = """
import runpy, sys, threading
threading.Thread(target=threading.Event().wait, daemon=True).start()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_where_the_kernel_refuses_auto_warns_and_runs_and_required_does_not_run() -> None:
    user = probe_user()
    python = probe_python()
    prefix = ["runuser", "-u", user.name, "--", python, "-c", THREADED,
              str(ENGINE_LAUNCH / "private_net.py")]  # fmt: skip
    command = ["--", python, "-c", "import os; print(os.readlink('/proc/self/ns/net'))"]
    auto = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=30)
    required = subprocess.run(
        [*prefix, "--required", *command], capture_output=True, text=True, timeout=30
    )
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.strip() == os.readlink("/proc/self/ns/net")  # the node's
    assert auto.stderr.startswith(
        "private network: cannot make a user and network namespace: Invalid argument; "
        f"starting {python} in the node's network namespace"
    ), auto.stderr
    assert "reachable by other users of the node" in auto.stderr
    assert required.returncode == private_net.CANNOT
    assert required.stdout == ""
    assert required.stderr == (
        "private network: cannot make a user and network namespace: Invalid argument; "
        f"not starting {python}\n"
    )


def test_no_command_and_a_missing_command_are_errors() -> None:
    with pytest.raises(SystemExit) as exited:
        private_net.main(["--"])
    assert exited.value.code == 2
    run = subprocess.run(
        [sys.executable, "-m", "hpcserve.engine_launch.private_net", "--", "/no/such/program"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 127
    assert "cannot run /no/such/program: No such file or directory" in run.stderr


# --- the HTTP socket: made by the engine, adopted by vLLM ------------------------------


# In a process of its own: importing vLLM warns (deprecations), and patches stay there.
SOCKET_MAKER = """
import socket
from hpcserve.engine_launch.vllm_api import install
from vllm.entrypoints.launchers import launcher
engine_made = socket.socket()
install(engine_made)
assert launcher.create_server_socket(("127.0.0.1", 0), reuse_port=False) is engine_made
second = launcher.create_server_socket(("127.0.0.1", 0), reuse_port=False)
assert second is not engine_made and second.getsockname()[0] == "127.0.0.1"
print("ok")
"""


def test_vllms_socket_maker_returns_the_engines_socket_once() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SOCKET_MAKER], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr[-3000:]


def test_only_a_listening_tcp_socket_is_adopted() -> None:
    read, write = os.pipe()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket()
    try:
        with pytest.raises(ValueError, match=f"HPCSERVE_HTTP_FD={read}: no open socket there"):
            adopted_socket(read)
        with pytest.raises(ValueError, match=f"HPCSERVE_HTTP_FD={udp.fileno()}: not a TCP socket"):
            adopted_socket(udp.fileno())
        with pytest.raises(ValueError, match=f"HPCSERVE_HTTP_FD={tcp.fileno()}: .* not listening"):
            adopted_socket(tcp.fileno())
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        adopted = adopted_socket(os.dup(tcp.fileno()))
        assert adopted.type == socket.SOCK_STREAM and not adopted.get_inheritable()
        adopted.close()
    finally:
        os.close(read)
        os.close(write)
        udp.close()
        tcp.close()


# --- which engines get it -------------------------------------------------------------


def _spec_mode(tmp_path: Path, **options: object) -> str:
    base: dict[str, object] = dict(
        model_path=str(tmp_path), served_model_name="m", router="tcp://127.0.0.1:1",
        engine="vllm-cpu", bind_host="127.0.0.1",
    )  # fmt: skip
    runner = EngineRunner(EngineOptions(**(base | options)))  # type: ignore[arg-type]
    try:
        return runner.spec.private_network
    finally:
        runner.release_ports()


def test_single_node_vllm_engines_get_it_and_the_rest_do_not(tmp_path: Path) -> None:
    assert _spec_mode(tmp_path) == "auto"
    assert _spec_mode(tmp_path, private_network="required") == "required"
    assert _spec_mode(tmp_path, private_network="off") == "off"
    assert _spec_mode(tmp_path, engine="sim") == "off"  # nothing of its listens but HTTP
    # other nodes must reach a multi-node replica's ranks, and a NIXL side channel
    multinode = dict(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=29500,
                     head_port=29501)  # fmt: skip
    assert _spec_mode(tmp_path, **multinode) == "off"
    nixl = ("--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert _spec_mode(tmp_path, extra_args=nixl) == "off"
    with pytest.raises(EngineFailed, match="--private-network must be one of auto, required"):
        _spec_mode(tmp_path, private_network="sometimes")


def test_a_given_http_port_taken_fails_before_vllm_starts(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", port))
        foreign.listen()
        options = EngineOptions(
            str(tmp_path), "m", "tcp://127.0.0.1:1", engine="vllm-cpu",
            bind_host="127.0.0.1", port=port,
        )  # fmt: skip
        runner = EngineRunner(options)
        runner.port_grace_s = 0
        try:
            with pytest.raises(EngineFailed) as failed:
                runner.launch_vllm()
        finally:
            runner.release_ports()
    assert runner.process is None  # nothing was started
    assert str(failed.value) == (
        f"cannot bind vLLM's HTTP port 127.0.0.1:{port}: Address already in use: the HTTP "
        f"server's port {port} is in use by another process (Address already in use); port "
        f"{port} was given to the engine, so it is not replaced: free it or pass another"
    )


def test_the_pool_manager_passes_the_choice_to_the_job_and_the_config_checks_it() -> None:
    from hpcserve.config import ConfigError, parse_config
    from hpcserve.poolmgr.spec import build_job_spec

    pool = {"name": "p", "model_path": "/m", "engine": "vllm"}
    default = parse_config({"pools": [pool]})
    assert default.engine.private_network == "auto"
    assert "HPCSERVE_PRIVATE_NETWORK" not in dict(build_job_spec(default, default.pools[0]).env)
    required = parse_config({"pools": [pool], "engine": {"private_network": "required"}})
    env = dict(build_job_spec(required, required.pools[0]).env)
    assert env["HPCSERVE_PRIVATE_NETWORK"] == "required"  # read by `hpcserve engine`
    with pytest.raises(ConfigError, match=r"engine\.private_network"):
        parse_config({"pools": [pool], "engine": {"private_network": "yes"}})
