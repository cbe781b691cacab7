"""The routing client against a real libzmq ROUTER: releases ride on the next Route, or go
alone soon; the Routes of one loop iteration leave as one multipart message; a router that
is not there costs RouterUnavailable at the deadline, and one that comes back is used again."""

import asyncio

import pytest
import zmq

from hpcserve.contracts import protocol as p
from hpcserve.gateway.routing_client import RELEASE_DELAY_S, RouterUnavailable, RoutingClient
from hpcserve.gateway.zmtp_dealer import encode_message, parse_endpoint
from tests.ports import free_port

# Out of reach unless a test shortens it: the router answers from the same loop, so a process
# descheduled for seconds must not turn a prompt answer into RouterUnavailable.
UNREACHED_S = 60.0


class FakeRouter:
    """A libzmq ROUTER answering Routes with replica r1 and ListReplicas with nothing."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.messages: list[list[p.RoutingMessage]] = []  # as they arrived, frame by frame

    async def next(self) -> list[p.RoutingMessage]:
        """The next message with a Route or Release in it (its frames decoded), answered."""
        while True:
            while not self.sock.poll(0):
                await asyncio.sleep(0.001)
            peer, *payloads = self.sock.recv_multipart()
            msgs = [p.routing_message_decoder.decode(x) for x in payloads]
            replies = []
            for msg in msgs:
                if isinstance(msg, p.ListReplicas):
                    replies.append(p.encode(p.ReplicaList(msg.request_id)))
                elif isinstance(msg, p.Route):
                    replies.append(
                        p.encode(
                            p.RouteReply(
                                msg.request_id, "r1", "u" * (1 + 3 * len(msg.block_hashes))
                            )
                        )
                    )
            if replies:
                self.sock.send_multipart([peer, *replies])
            wanted = [m for m in msgs if isinstance(m, p.Route | p.Release)]
            if wanted:
                return wanted

    def close(self) -> None:
        self.sock.close(0)


def test_releases_fold_into_the_next_route_or_are_sent_alone() -> None:
    async def scenario() -> tuple[list[object], list[p.RoutingMessage]]:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        router = FakeRouter(endpoint)
        client = RoutingClient(endpoint, timeout_s=UNREACHED_S)
        await client.start()
        try:
            client.release("r0")
            client.release("r1", "docs-a")  # a LoRA adapter's request: counted per adapter
            folded = await asyncio.gather(client.route("m"), router.next())
            client.release("r2", "docs-b")
            await asyncio.sleep(RELEASE_DELAY_S * 5)
            alone = await router.next()
        finally:
            await client.close()
            router.close()
        return list(folded), alone

    (reply, routes), alone = asyncio.run(scenario())
    assert [(m.released, m.released_models) for m in routes if isinstance(m, p.Route)] == [
        (["r0", "r1"], ["", "docs-a"])
    ]
    assert isinstance(reply, p.RouteReply) and reply.replica_id == "r1"
    assert alone == [p.Release("r2", "docs-b")]


def test_routes_of_one_loop_iteration_leave_as_one_message_and_long_frames_pass() -> None:
    hashes = list(range(1 << 40, (1 << 40) + 128))  # a Route of > 255 bytes: a long frame

    async def scenario() -> tuple[list[p.RouteReply], list[p.RoutingMessage]]:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        router = FakeRouter(endpoint)
        client = RoutingClient(endpoint, timeout_s=UNREACHED_S)
        await client.start()
        try:
            await asyncio.gather(client.route("warm-up"), router.next())
            replies = asyncio.gather(
                *(client.route("m", block_hashes=hashes, block_size=16) for _ in range(5))
            )
            message = await router.next()
            return list(await replies), message
        finally:
            await client.close()
            router.close()

    replies, message = asyncio.run(scenario())
    assert len(message) == 5 and all(m.block_hashes == hashes for m in message)  # type: ignore[union-attr]
    assert [r.url for r in replies] == ["u" * 385] * 5  # replies in long frames too


def test_no_router_costs_router_unavailable_then_a_late_router_is_used() -> None:
    async def scenario() -> p.RouteReply:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        client = RoutingClient(endpoint, timeout_s=0.3)
        await client.start()
        try:
            with pytest.raises(RouterUnavailable, match=r"route_timeout_s"):
                await client.route("m")
            client.timeout_s = UNREACHED_S  # the late router's answer is not raced
            router = FakeRouter(endpoint)
            try:
                client.view.router_away = False  # no replica set known: ask the router
                reply, _ = await asyncio.gather(client.route("m"), router.next())
            finally:
                router.close()
            return reply
        finally:
            await client.close()

    reply = asyncio.run(scenario())
    assert reply.replica_id == "r1"


@pytest.mark.parametrize(
    ("endpoint", "parsed"),
    [
        ("tcp://127.0.0.1:5555", ("tcp", "127.0.0.1", 5555)),
        ("tcp://router.cluster:7000", ("tcp", "router.cluster", 7000)),
        ("tcp://[::1]:7000", ("tcp", "::1", 7000)),
        ("ipc:///run/hpcserve/routing", ("ipc", "/run/hpcserve/routing", 0)),
    ],
)
def test_endpoints_parse(endpoint: str, parsed: tuple[str, str, int]) -> None:
    assert parse_endpoint(endpoint) == parsed


@pytest.mark.parametrize("endpoint", ["tcp://*:5555", "tcp://host", "inproc://x", "udp://h:1"])
def test_endpoints_that_cannot_be_dialled_are_refused_by_name(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"gateway\.routing_endpoint"):
        parse_endpoint(endpoint)


def test_frames_are_encoded_as_zmtp_puts_them_on_the_wire() -> None:
    assert encode_message([b"ab", b"c"]) == b"\x01\x02ab\x00\x01c"
    long = encode_message([b"x" * 300])
    assert long[:9] == b"\x02" + (300).to_bytes(8, "big") and len(long) == 309


def test_a_route_whose_request_gave_up_is_released_when_its_reply_comes() -> None:
    async def scenario() -> list[p.RoutingMessage]:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        router = FakeRouter(endpoint)
        client = RoutingClient(endpoint, timeout_s=UNREACHED_S)
        await client.start()
        try:
            asking = asyncio.ensure_future(client.route("m"))
            await asyncio.sleep(0.01)  # the Route is sent
            asking.cancel()  # the HTTP client went away before the reply
            await router.next()  # the router answers: replica r1 counted routed
            return await router.next()
        finally:
            await client.close()
            router.close()

    assert asyncio.run(scenario()) == [p.Release("r1")]
