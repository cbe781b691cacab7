"""The HTTP face of a simulated engine: the part of vLLM's OpenAI server hpcserve uses.

/health (200, empty), /metrics (vLLM's series), /v1/models, /v1/chat/completions and
/v1/completions, whole or streamed (SSE; chat's first chunk carries the role;
``stream_options.include_usage`` adds a last chunk with ``choices: []`` and the usage),
/reset_prefix_cache (POST, as vLLM's dev-mode endpoint) and /kv_event_sources. A request's
priority is the ``X-Vllm-Priority`` header, else the body's ``priority`` (vLLM's order). Errors
have vLLM's OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``. With a
KV-transfer connector (sim/transfer.py) the body's ``kv_transfer_params`` count, and a
whole answer carries the engine's ``kv_transfer_params`` (null when it has none).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hpcserve.sim.engine import EngineClosed, SimEngine
from hpcserve.sim.tokenizer import TokenizerError


def error(message: str, status: int, kind: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"max_tokens must be an integer, got {value!r}")
    return value


PRIORITY_HEADER = "x-vllm-priority"  # vLLM's; wins over the body's `priority`


def request_priority(request: Request, body: dict[str, Any]) -> int:
    header = request.headers.get(PRIORITY_HEADER)
    if header is not None:
        with contextlib.suppress(ValueError):
            return int(header)  # vLLM ignores a header that is not an integer
    value = body.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"priority must be an integer, got {value!r}")
    return value


def build_app(
    engine: SimEngine, *, lifespan: bool = True, rng: random.Random | None = None
) -> Starlette:
    """rng: draws the injected failures (SimConfig.error_rate)."""
    model = engine.config.served_model_name
    draw = (rng or random.Random()).random

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        card = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "hpcserve-sim",
            "root": engine.tokenizer.name,
            "parent": None,
            "max_model_len": engine.config.limits.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def reset_prefix_cache(request: Request) -> Response:
        if not engine.reset_prefix_cache():
            return error("requests hold KV blocks; the prefix cache was not reset", 409)
        return Response(status_code=200)

    async def kv_event_sources(request: Request) -> Response:
        ev = engine.config.kv_events
        if ev is None:
            return JSONResponse({"enable_kv_cache_events": False})
        return JSONResponse(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": ev.endpoint,
                "replay_endpoint": ev.replay_endpoint,
                "topic": ev.topic,
            }
        )

    async def complete(request: Request) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error("request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error("request body must be a JSON object", 400)
        if body.get("model") != model:
            return error(f"The model `{body.get('model')}` does not exist.", 404, "NotFoundError")
        if (body.get("n") or 1) != 1:
            return error("the simulated engine serves n=1 only", 400)
        if engine.config.error_rate and draw() < engine.config.error_rate:
            return error("injected failure (--sim-error-rate)", 500, "InternalServerError")
        try:
            max_tokens = _max_tokens(body, engine.config.default_max_tokens)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ValueError("messages must be a non-empty list")
                prompt_ids = engine.tokenizer.chat_ids(messages)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    prompt_ids = list(prompt)
                elif isinstance(prompt, str):
                    prompt_ids = engine.tokenizer.prompt_ids(prompt)
                else:
                    raise ValueError("prompt must be a string or a list of token ids")
            kv_params = body.get("kv_transfer_params")
            if kv_params is not None and not isinstance(kv_params, dict):
                raise ValueError("kv_transfer_params must be an object")
            salt = body.get("cache_salt") or ""
            if not isinstance(salt, str) or len(salt) > 128:
                raise ValueError("cache_salt must be a string of at most 128 characters")
            req = engine.submit(
                prompt_ids, max_tokens, request_priority(request, body), kv_params, salt
            )
        except (ValueError, TokenizerError) as err:
            return error(str(err), 400)
        except EngineClosed as err:
            return error(str(err), 503, "ServiceUnavailableError")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        reply = _Reply(rid, created, model, chat)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            include_usage = bool(options.get("include_usage"))
            # vLLM's continuous_usage_stats: the usage so far on every event, too.
            continuous = include_usage and bool(options.get("continuous_usage_stats"))
            return StreamingResponse(
                reply.stream(engine, req, include_usage, continuous),
                media_type="text/event-stream",
            )
        text: list[str] = []
        finish = "length"
        async for out in engine.stream(req):
            text.append(out.text)
            finish = out.finish_reason or finish
        answer = reply.whole("".join(text), finish, reply.usage(req))
        if engine.config.kv_transfer is not None:  # as vLLM's, with a connector
            answer["kv_transfer_params"] = engine.kv_transfer_answer(req)
        return JSONResponse(answer)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/chat/completions", complete, methods=["POST"]),
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/kv_event_sources", kv_event_sources),
        ],
        lifespan=_lifespan(engine) if lifespan else None,
    )


def _lifespan(engine: SimEngine) -> Any:
    @contextlib.asynccontextmanager
    async def run(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    return run


class _Reply:
    def __init__(self, rid: str, created: int, model: str, chat: bool) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat

    @staticmethod
    def usage(req: Any) -> dict[str, Any]:
        prompt, completion = len(req.prompt_ids), len(req.output_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # vLLM's: local prefix-cache hits and KV transferred from a prefill replica.
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens + req.external_tokens},
        }

    def whole(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    async def stream(
        self, engine: SimEngine, req: Any, include_usage: bool, continuous: bool = False
    ) -> AsyncIterator[bytes]:
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            yield self._chunk([{"index": 0, "delta": delta, "finish_reason": None}])
        interval = engine.config.stream_interval
        pending: list[str] = []  # tokens not sent yet (--stream-interval)
        try:
            async for out in engine.stream(req):
                pending.append(out.text)
                # vLLM's rule: the first token at once, then every `interval`, and the last.
                if out.index and out.finish_reason is None and len(pending) < interval:
                    continue
                text = "".join(pending)
                pending.clear()
                choice: dict[str, Any] = {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                }
                if self.chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                yield self._chunk([choice], **({"usage": self.usage(req)} if continuous else {}))
        except EngineClosed:
            return
        if include_usage:
            yield self._chunk([], usage=self.usage(req))
        yield b"data: [DONE]\n\n"
