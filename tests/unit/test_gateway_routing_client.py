"""The routing client over real ZeroMQ: releases ride on the next Route, or go alone soon."""

import asyncio

import zmq

from hpcserve.gateway.routing_client import RELEASE_DELAY_S, RoutingClient
from hpcserve.router import protocol as p


def test_releases_fold_into_the_next_route_or_are_sent_alone() -> None:
    async def scenario() -> tuple[list[object], list[object]]:
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = RoutingClient(f"tcp://127.0.0.1:{port}", timeout_s=2)
        await client.start()

        async def answer() -> p.RoutingMessage:
            """The next Route or Release; the client's replica-view refreshes are answered."""
            while True:
                while not router.poll(0):
                    await asyncio.sleep(0.001)
                peer, payload = router.recv_multipart()
                msg = p.routing_message_decoder.decode(payload)
                if isinstance(msg, p.ListReplicas):
                    router.send_multipart([peer, p.encode(p.ReplicaList(msg.request_id))])
                    continue
                if isinstance(msg, p.Route):
                    reply = p.RouteReply(msg.request_id, "r1", "u")
                    router.send_multipart([peer, p.encode(reply)])
                return msg

        try:
            client.release("r0")
            client.release("r1")
            folded = await asyncio.gather(client.route("m"), answer())
            client.release("r2")
            await asyncio.sleep(RELEASE_DELAY_S * 5)
            alone = [await answer()]
        finally:
            await client.close()
            router.close(0)
        return list(folded), alone

    (reply, route), alone = asyncio.run(scenario())
    assert isinstance(route, p.Route) and route.released == ["r0", "r1"]
    assert isinstance(reply, p.RouteReply) and reply.replica_id == "r1"
    assert alone == [p.Release("r2")]
