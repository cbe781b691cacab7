"""A simulated engine that speaks the part of vLLM's OpenAI server that hpcserve uses.

`hpcserve engine --engine sim` starts this instead of vLLM, through the same supervision,
registration and drain code, so control-plane tests (pool manager, router, health) run real
Slurm jobs that are ready in a second instead of a minute. It is never a substitute for
vLLM where the engine itself is under test.

What it serves: /health, /metrics (vLLM's gauge names), /v1/models, /v1/chat/completions
and /v1/completions, streamed or whole, with usage. Timing is a plain model for now: a
fixed cost per prompt token and per output token (issue 8 replaces it with the roofline
model of hpcserve.planner). SIGTERM drains like vLLM with --shutdown-timeout: new requests
are refused, running ones finish, then the process exits.

`--headless` stands in for a headless vLLM on node rank > 0 of a multi-node replica: it
serves nothing and exits 0 on SIGTERM or SIGINT, so multi-node wiring (srun, ranks, drain)
can be tested without vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


class SimEngine:
    def __init__(
        self,
        model: str,
        *,
        prefill_s_per_token: float,
        decode_s_per_token: float,
        max_tokens_default: int = 16,
    ) -> None:
        self.model = model
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_per_token = decode_s_per_token
        self.max_tokens_default = max_tokens_default
        self.running = 0
        self.finished = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @staticmethod
    def prompt_tokens(body: dict[str, Any]) -> int:
        if "messages" in body:
            text = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            text = str(body.get("prompt", ""))
        return max(1, len(text.split()))

    def metrics_text(self) -> str:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        return "".join(
            [
                f"vllm:num_requests_running{labels} {self.running}.0\n",
                f"vllm:num_requests_waiting{labels} 0.0\n",
                f"vllm:kv_cache_usage_perc{labels} 0.0\n",
                f"vllm:prompt_tokens_total{labels} {self.prompt_tokens_total}.0\n",
                f"vllm:generation_tokens_total{labels} {self.generation_tokens_total}.0\n",
                f"vllm:request_success_total{labels} {self.finished}.0\n",
            ]
        )

    async def generate(self, prompt_tokens: int, max_tokens: int) -> AsyncIterator[str]:
        self.running += 1
        self.prompt_tokens_total += prompt_tokens
        try:
            await asyncio.sleep(prompt_tokens * self.prefill_s_per_token)
            for i in range(max_tokens):
                await asyncio.sleep(self.decode_s_per_token)
                self.generation_tokens_total += 1
                yield f" tok{i}"
        finally:
            self.running -= 1
            self.finished += 1


def build_app(engine: SimEngine) -> Starlette:
    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(engine.metrics_text())

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": engine.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "hpcserve-sim",
                    }
                ],
            }
        )

    async def complete(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        if body.get("model") != engine.model:
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model `{body.get('model')}` does not exist.",
                        "type": "NotFoundError",
                        "param": None,
                        "code": 404,
                    }
                },
                status_code=404,
            )
        max_tokens = int(
            body.get("max_completion_tokens") or body.get("max_tokens") or engine.max_tokens_default
        )
        prompt = engine.prompt_tokens(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": max_tokens,
            "total_tokens": prompt + max_tokens,
        }
        if body.get("stream"):
            return StreamingResponse(
                _stream(
                    engine,
                    rid,
                    created,
                    chat,
                    prompt,
                    max_tokens,
                    usage,
                    bool((body.get("stream_options") or {}).get("include_usage")),
                ),
                media_type="text/event-stream",
            )
        text = "".join([t async for t in engine.generate(prompt, max_tokens)])
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": engine.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/chat/completions", complete, methods=["POST"]),
            Route("/v1/completions", complete, methods=["POST"]),
        ]
    )


async def _stream(
    engine: SimEngine,
    rid: str,
    created: int,
    chat: bool,
    prompt: int,
    max_tokens: int,
    usage: dict[str, int],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": engine.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(payload)}\n\n".encode()

    if chat:
        yield event(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )
    sent = 0
    async for token in engine.generate(prompt, max_tokens):
        sent += 1
        last = sent == max_tokens
        piece = {"content": token} if chat else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
        if chat:
            choice["delta"] = piece
        else:
            choice["text"] = token
        yield event([choice])
    if include_usage:
        yield event([], usage=usage)
    yield b"data: [DONE]\n\n"


def wait_headless() -> None:
    """A headless rank: nothing to serve; exit 0 when told to stop."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headless", action="store_true", help="a worker-only rank: wait")
    parser.add_argument("--served-model-name", default="")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    parser.add_argument("--decode-ms-per-token", type=float, default=5.0)
    args, _unknown_vllm_args = parser.parse_known_args(argv)
    if args.headless:
        wait_headless()
        return
    if not args.served_model_name or not args.port:
        parser.error("--served-model-name and --port are required unless --headless")
    engine = SimEngine(
        args.served_model_name,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
        decode_s_per_token=args.decode_ms_per_token / 1000,
    )
    # uvicorn re-raises the SIGTERM it handled once it has drained; like vLLM, exit 0 instead.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(
        build_app(engine),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(args.shutdown_timeout),
    )


if __name__ == "__main__":
    main()
