"""Disaggregated prefill and decode (issue 22): pool kinds in the config, their rendering
into the engine's vLLM arguments and environment, the router's two picks, and the gateway's
prefill step against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import ConfigError, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.contracts.engine_args import (
    NIXL_CONNECTOR,
    SIM_CONNECTOR,
    STORAGE_CONNECTOR,
    kv_connector,
    kv_connector_of,
    kv_storage_dir_of,
    kv_transfer_args,
)
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.engine_launch.engine import make_kv_storage_private
from hpcserve.engine_launch.vllm_args import EngineSpec, vllm_env
from hpcserve.gateway import disagg
from hpcserve.gateway.relay import Relay
from hpcserve.poolmgr.spec import build_job_spec
from hpcserve.router.policies.base import RouteContext, RouteRequest
from hpcserve.router.policies.pd_roles import PdRoles
from hpcserve.router.registry import Registry
from hpcserve.router.server import RouterServer
from tests.routers import loopback_router_config

# --- config ------------------------------------------------------------------------------

CPU = {"model_path": "/m", "engine": "vllm-cpu", "served_model_name": "chat"}
PREFILL = {**CPU, "name": "chat-prefill", "role": "prefill", "kv_transfer_dir": "/shared/kv"}
DECODE = {**CPU, "name": "chat-decode", "role": "decode", "kv_transfer_dir": "/shared/kv"}


@pytest.mark.parametrize(
    ("pools", "error"),
    [
        ([PREFILL], r"pools\[0\]\.role: .*no decode pool"),
        ([DECODE], r"pools\[0\]\.role: .*no prefill pool"),
        ([PREFILL, {**DECODE, "engine": "vllm"}], r"pools\[0\]\.engine: .*same engine kind"),
        (
            [{**PREFILL, "kv_transfer_dir": ""}, {**DECODE, "kv_transfer_dir": ""}],
            r"pools\[0\]\.kv_transfer_dir: a vllm-cpu prefill pool",
        ),
        (
            [PREFILL, {**DECODE, "kv_transfer_dir": "/other"}],
            r"pools\[0\]\.kv_transfer_dir: .*differs",
        ),
        ([{**CPU, "name": "chat", "kv_transfer_dir": "/x"}], r"pools\[0\]\.kv_transfer_dir: only"),
        ([PREFILL, DECODE, {**PREFILL, "name": "chat-prefill2"}], "two pools of role 'prefill'"),
    ],
)
def test_prefill_and_decode_pools_are_validated(pools, error):
    with pytest.raises(ConfigError, match=error):
        parse_config({"pools": pools})


def test_a_gpu_pair_needs_no_directory_and_a_pair_may_sit_beside_an_interactive_pool():
    gpu = {"model_path": "/m", "engine": "vllm", "served_model_name": "big"}
    config = parse_config(
        {
            "pools": [
                {**gpu, "name": "big-prefill", "role": "prefill"},
                {**gpu, "name": "big-decode", "role": "decode"},
                {**gpu, "name": "big"},
            ]
        }
    )
    assert [pool.role for pool in config.pools] == ["prefill", "decode", "interactive"]


# --- rendering ---------------------------------------------------------------------------


def _config(args: list[str]) -> dict[str, Any]:
    assert args[0] == "--kv-transfer-config"
    return json.loads(args[1])


@pytest.mark.parametrize(
    ("role", "engine", "expected"),
    [
        ("prefill", "vllm", {"kv_connector": NIXL_CONNECTOR, "kv_role": "kv_producer"}),
        ("decode", "vllm", {"kv_connector": NIXL_CONNECTOR, "kv_role": "kv_consumer"}),
        (
            "prefill",
            "vllm-cpu",
            {
                "kv_connector": STORAGE_CONNECTOR,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": "/shared/kv"},
            },
        ),
        (
            "decode",
            "vllm-cpu",
            {
                "kv_connector": STORAGE_CONNECTOR,
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"shared_storage_path": "/shared/kv"},
            },
        ),
        ("interactive", "vllm", None),
        ("batch", "vllm-cpu", None),
        # The simulator models the transfer itself (sim/transfer.py), under its own name.
        ("prefill", "sim", {"kv_connector": SIM_CONNECTOR, "kv_role": "kv_producer"}),
        ("decode", "sim", {"kv_connector": SIM_CONNECTOR, "kv_role": "kv_consumer"}),
    ],
)
def test_kv_transfer_args_by_role_and_engine(role, engine, expected):
    args = kv_transfer_args(role, engine, [], "/shared/kv")
    if expected is None:
        assert args == []
    else:
        assert _config(args) == expected
        assert kv_connector_of(args) == kv_connector(engine) == expected["kv_connector"]


def test_the_pools_own_connector_wins():
    own = ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}']
    assert kv_transfer_args("prefill", "vllm", own) == []
    assert kv_transfer_args("prefill", "vllm", ["--kv-transfer-config=" + own[1]]) == []
    assert kv_connector_of(own) == "LMCacheConnectorV1"
    assert kv_connector_of(["--kv-transfer-config", "{not json"]) == ""
    assert kv_connector_of(["--max-model-len", "1024"]) == ""


@pytest.mark.parametrize(
    ("engine_args", "expected"),
    [
        (kv_transfer_args("decode", "vllm-cpu", [], "/shared/kv"), "/shared/kv"),
        (kv_transfer_args("decode", "vllm", [], "/shared/kv"), ""),  # NIXL: no files
        (["--kv-transfer-config", '{"kv_connector_extra_config": []}'], ""),
        (["--kv-transfer-config", "{not json"], ""),
        (["--max-model-len", "1024"], ""),
    ],
)
def test_the_storage_connectors_directory_is_found(engine_args, expected):
    assert kv_storage_dir_of(engine_args) == expected


def test_the_engine_makes_the_kv_storage_directory_owner_only(tmp_path):
    storage = tmp_path / "kv"
    storage.mkdir()
    storage.chmod(0o755)
    make_kv_storage_private(kv_transfer_args("prefill", "vllm-cpu", [], str(storage)))
    assert storage.stat().st_mode & 0o777 == 0o700
    absent = tmp_path / "shared" / "kv"
    make_kv_storage_private(kv_transfer_args("decode", "vllm-cpu", [], str(absent)))
    assert absent.stat().st_mode & 0o777 == 0o700


def test_a_prefill_pools_job_gets_its_connector_and_role():
    config = parse_config({"pools": [PREFILL, DECODE]})
    prefill, decode = (build_job_spec(config, pool) for pool in config.pools)
    at = prefill.engine_args.index("--kv-transfer-config")
    assert json.loads(prefill.engine_args[at + 1])["kv_role"] == "kv_producer"
    at = decode.engine_args.index("--kv-transfer-config")
    assert json.loads(decode.engine_args[at + 1])["kv_role"] == "kv_consumer"
    assert ("HPCSERVE_POOL_ROLE", "prefill") in prefill.env
    assert ("HPCSERVE_POOL_ROLE", "decode") in decode.env


def test_a_nixl_engine_gets_its_own_side_channel_in_its_environment():
    spec = EngineSpec("/m", "big", "vllm", "python", "0.0.0.0", 8000)
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in vllm_env(spec, {})
    spec = EngineSpec("/m", "big", "vllm", "python", "0.0.0.0", 8000, nixl_host="n1", nixl_port=7)
    env = vllm_env(spec, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"})
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "n1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "7"  # not the job's: one per engine


def test_register_carries_the_connector_and_older_peers_still_decode_it():
    msg = p.Register("r", "m", "u", role="decode", kv_connector=STORAGE_CONNECTOR)
    back = p.registry_message_decoder.decode(p.encode(msg))
    assert back == msg
    reply = p.RouteReply(1, "d", "ud", prefill_replica_id="f", prefill_url="uf")
    assert p.routing_reply_decoder.decode(p.encode(reply)) == reply
    assert p.RouteReply(1, "d", "ud").prefill_replica_id == ""  # colocated: nothing new


# --- router ------------------------------------------------------------------------------


def fleet(roles: str, nodes: str | None = None) -> Registry:
    """One replica per letter: i interactive, p prefill, d decode; nodes: one letter each."""
    reg = Registry(lease_s=60)
    names = {"i": "interactive", "p": "prefill", "d": "decode"}
    for i, role in enumerate(roles):
        node = nodes[i] if nodes else "n"
        reg.register(p.Register(f"r{i}", "m", f"u{i}", node=node, role=names[role]), 0.0)
    return reg


def keep(reg: Registry, phase: str = "") -> list[bool] | None:
    ctx = RouteContext(RouteRequest("m", phase=phase), reg.table("m"))
    mask = PdRoles().keep(ctx)
    return None if mask is None else mask.tolist()


@pytest.mark.parametrize(
    ("roles", "phase", "expected"),
    [
        ("ii", "", None),  # no prefill pool: routes as before
        ("ii", "prefill", None),
        ("pd", "", [False, True]),
        ("pd", "prefill", [True, False]),
        ("ppdd", "prefill", [True, True, False, False]),
        ("pdi", "", [False, True, True]),
    ],
)
def test_pd_roles_keep_prefill_rows_for_the_prefill_step(roles, phase, expected):
    assert keep(fleet(roles), phase) == expected


def test_ordinary_picks_use_a_prefill_replica_only_when_nothing_else_is_usable():
    reg = fleet("pd")
    reg.set_routable("r1", False)
    assert keep(reg) is None
    assert keep(reg, "prefill") == [True, False]
    reg.set_routable("r0", False)
    assert keep(reg, "prefill") == [False, False]  # no prefill replica: none picked


@contextlib.contextmanager
def router(roles: str, nodes: str) -> Iterator[RouterServer]:
    """A router that never starts, with one replica per letter of roles (on nodes[i])."""
    server = RouterServer(
        loopback_router_config(lease_s=600.0), metrics_registry=CollectorRegistry()
    )
    names = {"i": "interactive", "p": "prefill", "d": "decode"}
    for i, role in enumerate(roles):
        server.registry.register(
            p.Register(f"r{i}", "m", f"http://u{i}", node=nodes[i], role=names[role]), 0.0
        )
    try:
        yield server
    finally:
        server.kv_events.close()  # the one socket a router that never started holds


def release(server: RouterServer, reply: p.RouteReply) -> None:
    for replica_id in (reply.replica_id, reply.prefill_replica_id):
        if replica_id:
            server._released(replica_id, "m")


def test_the_router_picks_prefill_then_decode_on_its_node():
    with router("ppdd", "abab") as server:
        reply = server.route(p.Route(1, "m"))
        assert reply.prefill_replica_id in ("r0", "r1")
        assert reply.replica_id in ("r2", "r3")
        prefill = server.registry.get(reply.prefill_replica_id)
        decode = server.registry.get(reply.replica_id)
        assert prefill is not None and decode is not None
        assert prefill.spec.node == decode.spec.node
        assert reply.prefill_url == prefill.spec.url
        assert prefill.in_flight == decode.in_flight == 1  # both counted until released
        release(server, reply)
        assert prefill.in_flight == decode.in_flight == 0


def test_the_decode_leaves_the_prefills_node_when_the_decode_replica_there_is_overloaded():
    with router("pdd", "aab") as server:
        server.registry.heartbeat("r1", p.ReplicaLoad(running=40, waiting=20), 0.0)
        reply = server.route(p.Route(1, "m"))
        assert (reply.prefill_replica_id, reply.replica_id) == ("r0", "r2")


def test_the_prefill_replica_is_picked_by_queue_and_the_decode_by_load():
    with router("ppdd", "aaaa") as server:
        server.registry.heartbeat("r0", p.ReplicaLoad(waiting=30), 0.0)
        server.registry.heartbeat("r2", p.ReplicaLoad(running=40, waiting=10, kv_usage=0.9), 0.0)
        for i in range(6):
            reply = server.route(p.Route(i, "m"))
            assert (reply.prefill_replica_id, reply.replica_id) == ("r1", "r3")
            release(server, reply)


def test_the_prefill_replica_is_picked_by_prefix_overlap():
    with router("ppd", "aaa") as server:
        hashes = prompt_block_hashes(list(range(1024)), 16)
        route = p.Route(1, "m", block_hashes=hashes, block_size=16, prompt_tokens=1024)
        first = server.route(route)
        release(server, first)
        # The first pick's blocks count as cached there (the approximate index): it sticks.
        for i in range(5):
            again = server.route(msgspec.structs.replace(route, request_id=2 + i))
            assert again.prefill_replica_id == first.prefill_replica_id
            release(server, again)


def test_without_a_usable_prefill_replica_the_decode_replica_serves_it_whole():
    with router("pd", "aa") as server:
        server.registry.set_routable("r0", False)
        reply = server.route(p.Route(1, "m"))
        assert (reply.replica_id, reply.prefill_replica_id, reply.prefill_url) == ("r1", "", "")
        # A retry that excluded the prefill replica: the same.
        server.registry.set_routable("r0", True)
        reply = server.route(p.Route(2, "m", exclude=["r0"]))
        assert (reply.replica_id, reply.prefill_replica_id) == ("r1", "")
    # An interactive replica of the model, picked for the decode, serves it whole too, and
    # the prefill replica picked first is not left counted.
    with router("pi", "aa") as server:
        reply = server.route(p.Route(3, "m"))
        assert (reply.replica_id, reply.prefill_replica_id) == ("r1", "")
        prefill = server.registry.get("r0")
        assert prefill is not None and prefill.in_flight == 0


def test_a_model_without_prefill_pool_routes_as_before():
    with router("ii", "ab") as server:
        reply = server.route(p.Route(1, "m"))
        assert reply.replica_id in ("r0", "r1") and reply.prefill_replica_id == ""


# --- gateway -----------------------------------------------------------------------------

Script = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def engine(script: Script) -> AsyncIterator[str]:
    """A real HTTP server on loopback answering each request (one per connection) by script,
    which sees the request body."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await script(await reader.readexactly(length), writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        server.close()


def answer(status: int, payload: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload


CLIENT = json.dumps(
    {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
    }
).encode()


def test_the_prefill_step_asks_for_one_token_and_passes_the_transfer_parameters_on():
    seen: list[dict[str, Any]] = []
    params = {"remote_engine_id": "e1", "remote_block_ids": [3, 4], "do_remote_prefill": True}

    async def prefill_engine(body: bytes, writer: asyncio.StreamWriter) -> None:
        seen.append(json.loads(body))
        writer.write(answer(200, json.dumps({"id": "x", "kv_transfer_params": params}).encode()))

    async def run() -> dict[str, Any] | None:
        relay = Relay(upstream_timeout_s=30.0)
        async with engine(prefill_engine) as url:
            try:
                return await disagg.prefill(relay, url, CLIENT, {})
            finally:
                await relay.close()

    got = asyncio.run(run())
    assert got == params
    [sent] = seen
    assert sent["max_tokens"] == 1 and sent["kv_transfer_params"] == disagg.PREFILL_PARAMS
    assert "stream" not in sent and "stream_options" not in sent and "n" not in sent
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    decode = json.loads(disagg.decode_body(CLIENT, got))
    assert decode["kv_transfer_params"] == params and decode["stream"] is True
    assert decode["max_tokens"] == 50
    assert disagg.decode_body(CLIENT, None) == CLIENT  # the storage connector: unchanged


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (answer(500, b'{"error": "boom"}'), "answered 500"),
        (answer(200, b"[1, 2]"), "something else than a completion"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{", "engine"),  # broke off
        (None, "did not answer within"),  # silent
    ],
)
def test_a_failed_prefill_step_is_reported_never_waited_on(reply, why):
    async def prefill_engine(body: bytes, writer: asyncio.StreamWriter) -> None:
        if reply is None:
            await asyncio.sleep(3600)
        writer.write(reply)

    async def run() -> None:
        relay = Relay(upstream_timeout_s=0.5)
        async with engine(prefill_engine) as url:
            try:
                with pytest.raises(disagg.PrefillFailed, match=why):
                    await disagg.prefill(relay, url, CLIENT, {})
            finally:
                await relay.close()

    asyncio.run(run())


def test_an_unreachable_prefill_replica_is_reported():
    async def run() -> None:
        relay = Relay(upstream_timeout_s=5.0, connect_timeout_s=5.0)
        try:
            with pytest.raises(disagg.PrefillFailed, match=r"unreachable|refused|connect"):
                await disagg.prefill(relay, "http://127.0.0.1:9/v1/chat/completions", CLIENT, {})
        finally:
            await relay.close()

    asyncio.run(run())
