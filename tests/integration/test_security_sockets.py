"""Issue 18, the socket half, as another cluster user sees it: a router with CURVE keys and
a real vLLM CPU engine started by `hpcserve engine`, and a second, unprivileged Unix user
(tests/unprivileged.py) on the same host. vLLM publishes its KV-cache events (every prompt's
token ids) on ipc:// sockets in a directory only the service account may enter, and the
engine's agent relays them to the router over CURVE: the probe user cannot even connect to
the publisher or the replay socket (permission denied), and the router's KV relay socket,
its routing socket and its registry socket refuse it at the handshake (no key), so it
registers no replica and no routing message of its reaches the router. The stack's own
events still arrive: the index fills from a prompt sent to vLLM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hpcserve.contracts import protocol as p
from hpcserve.contracts.cache_salt import tenant_salt
from hpcserve.contracts.curve import generate_keys
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.contracts.prompt_tokens import PromptTokenizer
from hpcserve.router.server import RouterServer
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import wait_for
from tests.routers import loopback_router_config, running_router
from tests.unprivileged import probe_user, readable_by_probe, run_python_as

pytestmark = pytest.mark.vllm


@dataclass
class Running:
    router: RouterServer
    keys: Path
    engine: subprocess.Popen[bytes]
    log: Path
    url: str  # vLLM's
    kv_dir: Path  # where vLLM's KV-event sockets are
    model: Path


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    probe_user()  # skips unless root, before anything starts
    tmp = tmp_path_factory.mktemp("sockets")
    keys = generate_keys(tmp / "curve")
    model = make_tiny_model("chat", tmp / "tiny-chat")
    config = loopback_router_config(curve_dir=str(keys), lease_s=10.0, heartbeat_s=1.0)
    log = tmp / "engine.log"
    with running_router(config) as router, log.open("w") as out:
        engine = subprocess.Popen(
            [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "vllm-cpu",
             "--model-path", str(model), "--served-model-name", "tiny", "--pool", "sec",
             "--router", config.registry_bind, "--curve-dir", str(keys),
             "--bind-host", "127.0.0.1", "--advertise-host", "127.0.0.1",
             "--heartbeat-s", "1", "--drain-s", "1",
             # two workers: their collectives go over the gloo listeners the test looks at
             "--tensor-parallel", "2",
             "--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )  # fmt: skip
        try:
            replica = wait_for(
                "the engine registered",
                lambda: next(iter(router.registry), None) or _exited(engine, log),
                timeout=600,
            )
            assert replica.spec.kv_events_relayed and not replica.spec.kv_events_endpoint
            (events,) = set(re.findall(r"ipc://([^\s\"',]+?)/events", log.read_text()))
            yield Running(router, keys, engine, log, replica.spec.url, Path(events), model)
        finally:
            engine.terminate()
            engine.wait(120)


def _exited(engine: subprocess.Popen[bytes], log: Path) -> None:
    assert engine.poll() is None, log.read_text()[-3000:]


def test_the_stacks_own_kv_events_reach_the_router_through_the_agent(running: Running) -> None:
    ingest = running.router.kv_events.metrics.ingest
    before = ingest.blocks
    prompt = "The router learns which engine holds which prefix. " * 40  # > 2 blocks of 128
    reply = httpx.post(
        running.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    wait_for("BlockStored relayed to the router", lambda: ingest.blocks > before, timeout=60)
    assert running.router.kv_events.metrics.bad._value.get() == 0
    assert "relaying KV events of" in running.log.read_text()


def test_a_tenants_salted_blocks_are_indexed_under_its_salt(running: Running) -> None:
    """vLLM publishes a request's cache_salt in its first block's extra keys: the router's
    index chains those blocks from the salted seed (contracts/cache_salt.py), so the
    gateway's salted hints for that tenant match them and unsalted ones do not."""
    index = running.router.decider.index
    salt = tenant_salt("team-a")
    prompt = "Each tenant has a prefix cache of its own, and the router knows it. " * 30
    tokens = PromptTokenizer.from_dir(running.model).prompt_tokens(prompt)
    reply = httpx.post(
        running.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": salt},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    (replica_id,) = [r.replica_id for r in running.router.registry]
    size = index.block_size(replica_id)
    salted = prompt_block_hashes(tokens, size, "", salt)
    assert len(salted) >= 2
    wait_for(
        "the salted blocks indexed",
        lambda: index.match(salted).get(replica_id, 0) == len(salted),
        timeout=60,
    )
    assert index.match(prompt_block_hashes(tokens, size)) == {}
    assert index.match(prompt_block_hashes(tokens, size, "", tenant_salt("team-b"))) == {}


CONNECT_AS_PROBE = """
import json, socket, sys
out = {}
for name in ("events", "replay"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1] + "/" + name)
        out[name] = "connected"
    except OSError as err:
        out[name] = type(err).__name__
    finally:
        s.close()
try:
    import os
    os.listdir(sys.argv[1])
    out["list"] = "listed"
except OSError as err:
    out["list"] = type(err).__name__
print(json.dumps(out))
"""


def test_another_user_cannot_reach_vllms_kv_event_sockets(running: Running) -> None:
    directory = running.kv_dir
    assert directory.stat().st_mode & 0o777 == 0o700
    assert (directory / "events").exists() and (directory / "replay").exists()
    run = run_python_as(CONNECT_AS_PROBE, str(directory))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {
        "events": "PermissionError",
        "replay": "PermissionError",
        "list": "PermissionError",
    }


def _tree(root: int) -> set[int]:
    """`root` and every process descending from it (vLLM's API server, engine core, workers)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(raw[raw.rfind(")") + 2 :].split()[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in tree and pid not in tree}
        tree |= more
        grew = bool(more)
    return tree


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    """Socket inode -> the pid holding it, over `pids`' open files."""
    held: dict[int, int] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                held[int(target[8:-1])] = pid
    return held


def _listening(
    inodes: dict[int, int], netns_of: int | None = None
) -> tuple[list[str], list[tuple[int, int]]]:
    """The listening unix socket paths ("@name" for abstract ones) and TCP (port, pid) of
    the given socket inodes, from /proc/net/{unix,tcp,tcp6}: those of this process's network
    namespace, or of the namespace of the process `netns_of`."""
    net = Path("/proc/net") if netns_of is None else Path(f"/proc/{netns_of}/net")
    unix = []
    for line in (net / "unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Flags 00010000: accepting connections (listening).
        if len(fields) >= 8 and int(fields[6]) in inodes and int(fields[3], 16) & 0x10000:
            unix.append(fields[7])
    tcp = []
    for table in ("tcp", "tcp6"):
        for line in (net / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and (not inodes or int(fields[9]) in inodes):  # LISTEN
                tcp.append((int(fields[1].rsplit(":", 1)[1], 16), inodes.get(int(fields[9]), 0)))
    return unix, tcp


CONNECT_UNIX_AS_PROBE = """
import json, socket, sys
out = {}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        out[path] = "connected"
    except OSError as err:
        out[path] = type(err).__name__
    finally:
        s.close()
print(json.dumps(out))
"""


CONNECT_TCP_AS_PROBE = """
import json, socket, sys
out = {}
for port in sys.argv[1:]:
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        out[port] = "connected"
    except OSError as err:
        out[port] = type(err).__name__
print(json.dumps(out))
"""


def _net_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_every_socket_vllm_listens_on_is_closed_to_another_user(running: Running) -> None:
    """vLLM's own ZeroMQ sockets between its API server, engine core and workers are ipc://
    paths; by default under /tmp, with the umask's mode. The engine puts them, and the
    KV-event ones, in its private directory (VLLM_RPC_BASE_PATH): the probe user can
    connect to none. Over TCP, the node sees vLLM listen on its HTTP port alone (401 without
    the engine token, test_security_probe.py): torch.distributed's gloo listeners, which
    have no authentication, are on the loopback of vLLM's own network namespace
    (engine_launch/private_net.py), which no other user's process can reach."""
    tree = _tree(running.engine.pid)
    inodes = _socket_inodes(tree)
    # vLLM's processes are in a network namespace the engine (and so the probe) is not in;
    # the sockets they made are listed there
    workers = [pid for pid in tree if _comm(pid).startswith("VLLM::Worker")]
    assert len(workers) == 2, {pid: _comm(pid) for pid in tree}
    assert len({_net_namespace(pid) for pid in workers}) == 1
    assert _net_namespace(workers[0]) != _net_namespace(running.engine.pid)
    assert re.search(r"vLLM ready at \S+ after \d+s, in a network namespace of its own",
                     running.log.read_text())  # fmt: skip
    unix, hidden = _listening(inodes, netns_of=workers[0])
    directory = running.kv_dir
    # The API server's, the engine core's and the worker's ZMQ sockets, events and replay.
    assert len(unix) >= 6, unix
    assert all(Path(path).parent == directory for path in unix), unix
    run = run_python_as(CONNECT_UNIX_AS_PROBE, *unix)
    assert run.returncode == 0, run.stderr
    assert set(json.loads(run.stdout).values()) == {"PermissionError"}, run.stdout
    # In the node's namespace, vLLM's one TCP listener is the HTTP socket the engine made
    http_port = int(running.url.rsplit(":", 1)[1])
    _, tcp = _listening(inodes)
    assert {port for port, _ in tcp} == {http_port}, tcp
    # In vLLM's, the worker's gloo listeners: each refuses the probe (nothing listens on
    # that port where the probe is; a port something of the node's own listens on is left
    # out, as it is not vLLM's)
    gloo = {port for port, pid in hidden if pid in workers}
    assert gloo, hidden
    node_ports = {port for port, _ in _listening({})[1]}
    run = run_python_as(CONNECT_TCP_AS_PROBE, *map(str, sorted(gloo - node_ports)))
    assert run.returncode == 0, run.stderr
    assert set(json.loads(run.stdout).values()) <= {"ConnectionRefusedError"}, run.stdout


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# A ZeroMQ peer as the probe user: connects (plain, or CURVE with a key pair of its own and
# a guess at the server's key), sends one message, and prints what its handshake came to.
ZMQ_AS_PROBE = """
import sys, zmq
from zmq.utils.monitor import recv_monitor_message
endpoint, kind, payload = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.linger = 0
if kind == "curve":
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = zmq.curve_keypair()[0]
monitor = sock.get_monitor_socket()
sock.connect(endpoint)
sock.send(payload)
names = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded",
         zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
         zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused",
         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused",
         zmq.EVENT_DISCONNECTED: "refused"}
outcome = "no event"
while monitor.poll(30000):
    event = recv_monitor_message(monitor)["event"]
    if event in names:
        outcome = names[event]
        break
print(outcome)
"""


def _probe_zmq(endpoint: str, kind: str, message: bytes) -> str:
    run = run_python_as(ZMQ_AS_PROBE, endpoint, kind, message.hex(), timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_routers_sockets_refuse_another_user(running: Running) -> None:
    router, config = running.router, running.router.config
    routing = router._routing
    assert routing is not None
    refused = routing.refused
    usage = p.QuotaReport(1, "probe", [p.TenantUsage("team-a", requests=10**6)])
    for kind in ("plain", "curve"):
        # The routing socket: a listing, and a quota report that would inflate a tenant.
        assert _probe_zmq(config.routing_bind, kind, p.encode(p.ListReplicas(1))) == "refused"
        assert _probe_zmq(config.routing_bind, kind, p.encode(usage)) == "refused"
        # The registry: a replica of its own, pointing at its own server.
        fake = p.Register("planted", "tiny", "http://127.0.0.1:9", kv_events_relayed=True)
        assert _probe_zmq(config.registry_bind, kind, p.encode(fake)) == "refused"
        # The KV relay socket: events for the real replica's topic.
        assert _probe_zmq(router.kv_events.relay_endpoint, kind, b"kv") == "refused"
    # Each of its routing connections ended at the handshake (counted as the router reads
    # the greeting or HELLO, which may be after the probe saw its connection fail).
    wait_for("the probes' routing connections refused", lambda: routing.refused >= refused + 4)
    assert [r.replica_id for r in router.registry if r.replica_id == "planted"] == []
    assert "team-a" not in router.quotas._by_tenant  # no usage of its was ever booked
    # And it cannot read the keys that would let it in.
    assert not readable_by_probe(running.keys / "engine.key_secret")
    assert not readable_by_probe(running.keys / "gateway.key_secret")
