"""What the simulated engine tells the outside as a real vLLM and its agent would: its KV
capacity on each heartbeat, replies without Nagle's delay; and its per-request trace."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

from hpcserve.sim.engine import SimConfig, SimEngine
from hpcserve.sim.fleet import _bound_socket
from hpcserve.sim.timing import fixed_hardware
from hpcserve.sim.tokenizer import WordTokenizer


def _engine(trace: Path | None = None) -> SimEngine:
    hw = fixed_hardware(0.0, 0.0, kv_blocks=100, block_size=16)
    config = SimConfig("m", hw, request_trace=str(trace) if trace else "")
    return SimEngine(config, WordTokenizer())


def test_the_load_carries_the_kv_capacity_in_tokens() -> None:
    # The engine agent reports a real vLLM's num_gpu_blocks x block_size; the router's
    # placement by KV room (policies/scorers.py KvPressure) needs it on the fleet too.
    assert _engine().load().kv_capacity_tokens == 100 * 16


def test_each_finished_request_is_traced_with_what_the_replica_was_doing(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.jsonl"
    engine = _engine(trace)

    async def serve() -> None:
        await engine.start()
        try:
            together = [engine.submit(list(range(20, 84)), 2), engine.submit([9] * 32, 2)]
            for req in together:
                async for _ in engine.stream(req):
                    pass
            async for _ in engine.stream(engine.submit(list(range(20, 84)) + [99] * 16, 2)):
                pass
        finally:
            await engine.stop()

    asyncio.run(serve())
    first, second, third = [json.loads(line) for line in trace.read_text().splitlines()]
    assert first["prompt"] == 64 and first["waiting"] == 0 and first["prefill_ahead"] == 0
    assert second["waiting"] == 1 and second["prefill_ahead"] == 64  # behind the first
    assert third["prompt"] == 80 and third["cached"] == 64  # the first one's blocks
    assert third["running"] == third["waiting"] == 0
    assert all(r["ttft_s"] >= 0 and r["queue_s"] >= 0 for r in (first, second, third))


def test_replies_on_a_fleet_socket_are_not_held_back_by_nagle() -> None:
    async def accepted_nodelay() -> int:
        listener = _bound_socket("127.0.0.1")
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            result = await asyncio.wait_for(seen, 5)
            writer.close()
            return result

    assert asyncio.run(accepted_nodelay())
