"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) at the gateway.

A Messages request is checked (errors in Anthropic's shape, {"type": "error", "error":
{"type": "invalid_request_error", "message": ...}}), translated to a chat completion and
sent through the gateway's own path (`Gateway.relay_parsed`: allowed models, quota,
priority, prefix-aware routing, retry, overflow, metrics, audit); the answer comes back as
an Anthropic message or, streamed, as Anthropic's events (message_start,
content_block_start/delta/stop, message_delta, message_stop). count_tokens is the length of
the same chat messages through the model's chat template, from a replica's /tokenize.

Clients authenticate as Anthropic's do, with `x-api-key: <key>` (or `Authorization: Bearer`).
A pool serves it unless it sets `messages_api = false` (pools[].messages_api).

Why translate rather than relay vLLM's own /v1/messages (which also works on 0.32's CPU
build): the same reasons as the Responses API (gateway/responses.py): metering, prefix hints,
retry and overflow all speak chat completions. Served: text and image blocks, system, tools
and tool_choice, tool_use / tool_result blocks, stop_sequences, temperature, top_p, top_k,
metadata.user_id. Extended thinking and documents are refused with a 400.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hpcserve.gateway import validate
from hpcserve.gateway.errors import APIError, bad_request
from hpcserve.gateway.model_tools import to_replica
from hpcserve.gateway.responses import decode_request, sse_data

if TYPE_CHECKING:
    from hpcserve.gateway.app import Gateway
    from hpcserve.gateway.auth import Tenant

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
Text = Annotated[str, msgspec.Meta(max_length=1_000_000)]


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: Text | list[dict[str, Any]]


class Tool(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(msgspec.Struct):
    user_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class CountRequest(msgspec.Struct):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    system: Text | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 0
    stream: bool = False
    stop_sequences: list[Annotated[str, msgspec.Meta(min_length=1)]] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    metadata: Metadata | None = None


_messages = msgspec.json.Decoder(MessagesRequest)
_count = msgspec.json.Decoder(CountRequest)
_any = msgspec.json.Decoder()

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def _from_api_error(err: APIError) -> Response:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else None
    return anthropic_error(err.status, err.message, headers)


def _from_openai_body(status: int, body: bytes) -> Response:
    """An engine's (or the relay's) OpenAI-shaped error as Anthropic's."""
    message = f"The engine answered {status}"
    try:
        decoded = _any.decode(body)
    except msgspec.DecodeError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        if isinstance(error, dict) and error.get("message"):
            message = str(error["message"])
        elif decoded.get("message"):
            message = str(decoded["message"])
    return anthropic_error(status, message)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    request = decode_request(decoder, body)
    if request.thinking is not None and request.thinking.get("type") != "disabled":
        raise bad_request("thinking: extended thinking is not served here", param="thinking")
    return request


# -- Messages -> chat ------------------------------------------------------------------------


def _text_blocks(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of text blocks", param=where)
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(f"{where}[{i}]: expected a text block", param=f"{where}[{i}]")
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{i}].text: expected a string", param=f"{where}[{i}].text")
        texts.append(text)
    return "\n".join(texts)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    url = source.get("url") if isinstance(source, dict) else None
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(url, str) and url:
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(
        f"{where}.source: expected a base64 or url image source", param=f"{where}.source"
    )


def chat_messages(request: CountRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        system = _text_blocks(request.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for m, message in enumerate(request.messages):
        where = f"messages[{m}].content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for b, block in enumerate(message.content):
            at = f"{where}[{b}]"
            kind = block.get("type")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad_request(f"{at}.text: expected a string", param=f"{at}.text")
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and message.role == "user":
                parts.append(_image(block, at))
            elif kind == "tool_use" and message.role == "assistant":
                name, call_id = block.get("name"), block.get("id")
                if not isinstance(name, str) or not isinstance(call_id, str):
                    raise bad_request(f"{at}: a tool_use block needs id and name", param=at)
                arguments = json.dumps(block.get("input") or {})
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": arguments}})  # fmt: skip
            elif kind == "tool_result" and message.role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise bad_request(f"{at}.tool_use_id: expected a string", param=at)
                result = _text_blocks(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
            elif kind == "thinking" and message.role == "assistant":
                continue  # earlier turns' thinking is not sent back to the model
            else:
                raise bad_request(
                    f"{at}.type: {kind!r} is not served in a {message.role} message here",
                    param=f"{at}.type",
                )
        if not parts and not calls:
            continue  # tool results only
        content: Any = parts
        if all(p["type"] == "text" for p in parts):
            content = "".join(p["text"] for p in parts) if parts else None
        chat: dict[str, Any] = {"role": message.role, "content": content}
        if calls:
            chat["tool_calls"] = calls
        messages.append(chat)
    return messages


def _chat_tools(request: CountRequest) -> dict[str, Any]:
    chat: dict[str, Any] = {}
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(
                    f"tools[{i}].type: server tools ({tool.type!r}) are not served here",
                    param=f"tools[{i}].type",
                )
            validate.check_json_schema(tool.input_schema, f"tools[{i}].input_schema")
            function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        chat["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request(
                    "tool_choice.name: required with type 'tool'", param="tool_choice"
                )
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat


def chat_body(request: MessagesRequest) -> dict[str, Any]:
    if not request.max_tokens:
        raise bad_request("'max_tokens' is required", param="max_tokens")
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        "max_tokens": request.max_tokens,
        **_chat_tools(request),
    }
    if request.stop_sequences:
        chat["stop"] = request.stop_sequences
    for key in ("temperature", "top_p", "top_k"):
        if (value := getattr(request, key)) is not None:
            chat[key] = value
    if request.metadata is not None and request.metadata.user_id:
        chat["user"] = request.metadata.user_id
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# -- chat -> Messages ------------------------------------------------------------------------


def stop_reason(finish: str | None, matched: Any, has_calls: bool) -> tuple[str, str | None]:
    if has_calls or finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = {"arguments": function.get("arguments")}
    return {
        "type": "tool_use",
        "id": call.get("id") or f"toolu_{secrets.token_hex(12)}",
        "name": function.get("name", ""),
        "input": arguments if isinstance(arguments, dict) else {"value": arguments},
    }


def message_of(model: str, completion: dict[str, Any]) -> dict[str, Any]:
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if text := message.get("content"):
        content.append({"type": "text", "text": text})
    content.extend(_tool_use(c) for c in message.get("tool_calls") or ())
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), len(content) > bool(text)
    )
    usage = completion.get("usage") or {}
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
        },
    }


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    data = msgspec.json.encode({"type": kind, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def anthropic_stream(model: str, upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Anthropic's event stream of a streamed chat completion."""
    message: dict[str, Any] = {
        "id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
        "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }  # fmt: skip
    yield _event("message_start", {"message": message})
    yield _event("ping", {})
    index = -1  # the content block open now
    text_open = False
    calls: dict[int, int] = {}  # the chat tool call's index -> its content block
    finish: str | None = None
    matched: Any = None
    usage: dict[str, Any] = {}
    try:
        async for chunk in sse_data(upstream):
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                yield _event(
                    "error",
                    {"error": {"type": "api_error",
                               "message": str(error.get("message") or "The engine failed")}},
                )  # fmt: skip
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if text := delta.get("content"):
                    if not text_open:
                        if index >= 0:
                            yield _event("content_block_stop", {"index": index})
                        index += 1
                        text_open = True
                        block = {"type": "text", "text": ""}
                        yield _event(
                            "content_block_start", {"index": index, "content_block": block}
                        )
                    yield _event(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "text_delta", "text": text}},
                    )
                for call in delta.get("tool_calls") or ():
                    at = call.get("index", 0)
                    if at not in calls:
                        if index >= 0:
                            yield _event("content_block_stop", {"index": index})
                        index += 1
                        text_open = False
                        calls[at] = index
                        function = call.get("function") or {}
                        tool_block: dict[str, Any] = {"type": "tool_use",
                                 "id": call.get("id") or f"toolu_{secrets.token_hex(12)}",
                                 "name": function.get("name", ""), "input": {}}  # fmt: skip
                        yield _event(
                            "content_block_start", {"index": index, "content_block": tool_block}
                        )
                    if partial := (call.get("function") or {}).get("arguments"):
                        yield _event(
                            "content_block_delta",
                            {"index": calls[at],
                             "delta": {"type": "input_json_delta", "partial_json": partial}},
                        )  # fmt: skip
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                    matched = choice.get("stop_reason")
        if index >= 0:
            yield _event("content_block_stop", {"index": index})
        reason, sequence = stop_reason(finish, matched, bool(calls))
        yield _event(
            "message_delta",
            {"delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": {"input_tokens": int(usage.get("prompt_tokens") or 0),
                       "output_tokens": int(usage.get("completion_tokens") or 0)}},
        )  # fmt: skip
        yield _event("message_stop", {})
    finally:
        close = getattr(upstream, "aclose", None)
        if close is not None:
            await close()


# -- the endpoints ---------------------------------------------------------------------------


def _tenant(gateway: Gateway, request: Request) -> Tenant:
    """Anthropic's clients send `x-api-key`; Bearer works too."""
    authorization = request.headers.get("authorization")
    if authorization is None and (key := request.headers.get("x-api-key")):
        authorization = f"Bearer {key}"
    tenant = gateway.keys.tenant_for(authorization)
    request.scope["hpcserve.tenant"] = tenant.name
    request.scope["hpcserve.key"] = tenant
    return tenant


def _check_pool(gateway: Gateway, model: str) -> None:
    if model in gateway.messages_refused:
        raise bad_request(
            f"The model '{model}' does not serve the Messages API (its pool sets "
            "messages_api = false)",
            param="model",
        )


async def create_message(gateway: Gateway, request: Request) -> Response:
    try:
        tenant = _tenant(gateway, request)
        body = await gateway.read_body(request)
        req: MessagesRequest = _decode(_messages, body)
        request.scope["hpcserve.asked"] = req.model
        _check_pool(gateway, req.model)
        chat = msgspec.json.encode(chat_body(req))
        parsed = validate.parse(CHAT, chat)
        upstream = await gateway.relay_parsed(request, CHAT, tenant, parsed, chat)
    except APIError as err:
        return _from_api_error(err)
    if upstream.status_code != 200:
        return _from_openai_body(upstream.status_code, bytes(upstream.body))
    if isinstance(upstream, StreamingResponse):
        return StreamingResponse(
            anthropic_stream(req.model, upstream.body_iterator),  # type: ignore[arg-type]
            media_type="text/event-stream",
            background=upstream.background,
        )
    try:
        completion = _any.decode(upstream.body)
    except msgspec.DecodeError:
        return anthropic_error(502, "The engine's answer is not JSON")
    return JSONResponse(message_of(req.model, completion))


async def count_tokens(gateway: Gateway, request: Request) -> Response:
    try:
        tenant = _tenant(gateway, request)
        req: CountRequest = _decode(_count, await gateway.read_body(request))
        _check_pool(gateway, req.model)
        payload: dict[str, Any] = {"messages": chat_messages(req), **_chat_tools(req)}
        payload.pop("tool_choice", None)
        payload.pop("parallel_tool_calls", None)
        upstream = await to_replica(gateway, request, tenant, req.model, "/tokenize", payload)
    except APIError as err:
        return _from_api_error(err)
    if upstream.status_code != 200:
        return _from_openai_body(upstream.status_code, bytes(upstream.body))
    try:
        count = _any.decode(upstream.body)["count"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return anthropic_error(502, "The engine's /tokenize answer has no count")
    return JSONResponse({"input_tokens": int(count)})


Wrap = Callable[[Any, str, Any], Any]


def messages_routes(gateway: Gateway, wrap: Wrap) -> list[Route]:
    return [
        Route("/v1/messages", wrap(gateway, "messages", create_message), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens",
            wrap(gateway, "messages", count_tokens),
            methods=["POST"],
        ),
    ]
