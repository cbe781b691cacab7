"""OpenAI's Responses API (/v1/responses) at the gateway, translated to chat completions.

A create request is checked (`ResponsesRequest`: errors name the Responses field), expanded
with the stored conversation of its `previous_response_id` (gateway/responses_store.py), and
sent as a chat completion through the gateway's own path (`Gateway.relay_parsed`: allowed
models, quota, priority, prefix-aware routing, retry, overflow, metrics, audit). The engine
keeps no state (each turn carries the whole conversation), so a next turn may land on any
replica, after a drain, or after a gateway restart. The chat completion's answer becomes a
Response object, or, streamed, the Responses event stream (response.created ...
response.completed); a stored one is written before its client sees it complete.

Why not relay to vLLM's own /v1/responses (it works on 0.32 for text, with store=false and
the conversation expanded by the gateway): its usage comes as input/output_tokens, which the
relay's metering would have to learn for this endpoint alone; prefix hints, the overflow
API and the retry path all speak chat completions; and its answer carries vLLM-only fields.
docs/architecture.md, "The Responses API and its state".

Served: text and image input parts, function tools (calls and their outputs as input items),
tool_choice, text.format (json_object, json_schema), instructions, metadata, store,
previous_response_id, streaming; retrieve, delete, input_items. Refused with 400: background
mode (so cancel has nothing to cancel), built-in tools, item types other than messages and
function calls.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from prometheus_client import Counter, Gauge
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hpcserve.config import humanize_validation_error
from hpcserve.gateway import errors, json_limits, validate
from hpcserve.gateway.errors import APIError, bad_request
from hpcserve.gateway.responses_store import ResponseStore, StoredResponse

if TYPE_CHECKING:
    from hpcserve.gateway.app import Gateway
    from hpcserve.gateway.auth import Tenant

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
PosInt = Annotated[int, msgspec.Meta(ge=1)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class TextConfig(msgspec.Struct):
    format: dict[str, Any] | None = None


class ResponsesRequest(msgspec.Struct):
    """The fields the gateway translates or checks; others (reasoning, include,
    service_tier, ...) are accepted and ignored, as vLLM does."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    input: Annotated[str, msgspec.Meta(max_length=1_000_000)] | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: Id | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: PosInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, Annotated[str, msgspec.Meta(max_length=512)]] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None


_request = msgspec.json.Decoder(ResponsesRequest)
_any = msgspec.json.Decoder()


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def decode_request(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """A body typed by `decoder` (after json_limits' bounds), or a 400 naming the field."""
    json_limits.check_body(body)
    try:
        if not body.isascii():
            body.decode()  # msgspec skips unknown fields without checking their UTF-8
        return decoder.decode(body)
    except msgspec.ValidationError as err:
        text = str(err)
        if text.startswith("Expected `object`") and " - at " not in text:
            raise bad_request("Request body is not a JSON object") from None
        if text.startswith("Object missing required field"):
            field = text.partition("`")[2].partition("`")[0]
            raise bad_request(f"'{field}' is required", param=field) from None
        try:
            data = _any.decode(body)
        except msgspec.DecodeError:
            data = None
        message = humanize_validation_error(err, data)
        path = message.partition(":")[0]
        raise bad_request(message, param=None if path.startswith("(") else path) from None
    except msgspec.DecodeError as err:
        raise bad_request(f"Request body is not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise bad_request(
            f"Request body is not valid UTF-8: byte {err.object[err.start]:#04x} at {err.start}"
        ) from None
    except RecursionError:
        raise bad_request("Request body nests JSON too deeply") from None


def parse_request(body: bytes) -> ResponsesRequest:
    req: ResponsesRequest = decode_request(_request, body)
    if req.input in ("", []):
        raise bad_request("'input' is required and must not be empty", param="input")
    if req.background:
        raise bad_request(
            "background mode is not served by this gateway: send background=false "
            "(responses are returned, or streamed, as they are generated)",
            param="background",
        )
    if req.metadata is not None and len(req.metadata) > MAX_METADATA_KEYS:
        raise bad_request(
            f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(req.metadata)}",
            param="metadata",
        )
    return req


# -- Responses input -> chat messages ------------------------------------------------------


def _text_of(part: dict[str, Any], param: str) -> str:
    text = part.get("text", part.get("refusal"))
    if not isinstance(text, str):
        raise bad_request(f"{param}.text: expected a string", param=f"{param}.text")
    return text


def _chat_content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A Responses message's content as chat content: a string, or parts with images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad_request(
            f"{param}: expected a string or a non-empty list of content parts", param=param
        )
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise bad_request(f"{where}: expected an object", param=where)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": _text_of(part, where)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad_request(
                    f"{where}.image_url: expected a URL or data URL (file_id is not served)",
                    param=f"{where}.image_url",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_request(
                f"{where}.type: expected input_text, output_text or input_image, got {kind!r}",
                param=f"{where}.type",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(
    items: str | list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat messages, input items as stored for input_items) of a request's `input`."""
    if isinstance(items, str):
        item = {"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                "content": [{"type": "input_text", "text": items}]}  # fmt: skip
        return [{"role": "user", "content": items}], [item]
    messages: list[dict[str, Any]] = []
    stored: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role: expected user, system, developer or assistant, got {role!r}",
                    param=f"{where}.role",
                )
            content = _chat_content(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": content})
            parts = item["content"]
            if isinstance(parts, str):
                text_type = "output_text" if role == "assistant" else "input_text"
                parts = [{"type": text_type, "text": parts}]
            stored.append({"type": "message", "id": item.get("id") or new_id("msg"),
                           "role": role, "status": "completed", "content": parts})  # fmt: skip
        elif kind == "function_call":
            call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
            for key, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
                if not isinstance(value, str) or (key != "arguments" and not value):
                    raise bad_request(f"{where}.{key}: expected a string", param=f"{where}.{key}")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            stored.append({**item, "type": "function_call", "id": item.get("id") or new_id("fc"),
                           "status": "completed"})  # fmt: skip
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id: expected a string", param=f"{where}.call_id")
            if not isinstance(output, str):
                raise bad_request(f"{where}.output: expected a string", param=f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            stored.append({**item, "id": item.get("id") or new_id("fco"), "status": "completed"})
        else:
            raise bad_request(
                f"{where}.type: expected message, function_call or function_call_output, "
                f"got {kind!r}",
                param=f"{where}.type",
            )
    return messages, stored


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    chat = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type: only 'function' tools are served here, got {tool.get('type')!r}",
                param=f"tools[{i}].type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name: expected a string", param=f"tools[{i}].name")
        function: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        chat.append({"type": "function", "function": function})
    return chat


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise bad_request(
            "tool_choice: expected auto, none, required or {'type': 'function', 'name': ...}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(
        f"text.format.type: expected text, json_object or json_schema, got {kind!r}",
        param="text.format.type",
    )


def chat_body(
    req: ResponsesRequest, history: list[dict[str, Any]], new: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat completion a Responses request asks for: instructions (never carried over
    from the previous turn, as OpenAI's), the stored conversation, the new input."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat: dict[str, Any] = {"model": req.model, "messages": [*messages, *history, *new]}
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    for key in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if (value := getattr(req, key)) is not None:
            chat[key] = value
    if req.tools:
        chat["tools"] = _chat_tools(req.tools)
    if req.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and (chat_format := _response_format(fmt)) is not None:
        chat["response_format"] = chat_format
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# -- chat completion -> Response -------------------------------------------------------------


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call.get("id") or new_id("call"),
        "name": function.get("name", ""),
        "arguments": function.get("arguments") or "",
        "status": "completed",
    }


class Turn:
    """One create request on its way: what the Response object and the store need."""

    def __init__(
        self,
        req: ResponsesRequest,
        tenant: Tenant | None,
        history: list[dict[str, Any]],
        new: list[dict[str, Any]],
        stored_input: list[dict[str, Any]],
    ) -> None:
        self.req = req
        self.tenant = tenant
        self.history = history
        self.new = new
        self.stored_input = stored_input
        self.id = new_id("resp")
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        finish_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        req = self.req
        incomplete = None
        if finish_reason == "length":
            status = "incomplete"
            incomplete = {"reason": "max_output_tokens"}
        text_format = (req.text.format if req.text is not None else None) or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "store": req.store,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": req.truncation or "disabled",
            "usage": _usage(usage) if usage is not None else None,
            "user": req.user,
        }

    def record(self, response: dict[str, Any], assistant: dict[str, Any]) -> StoredResponse:
        return StoredResponse(
            id=self.id,
            tenant=self.tenant.name if self.tenant is not None else "",
            created_at=time.time(),
            model=self.req.model,
            response=response,
            input_items=self.stored_input,
            history=[*self.history, *self.new, assistant],
        )


def assistant_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {"id": c["call_id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]  # fmt: skip
    return message


def completed(turn: Turn, completion: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Response object, the assistant message for the history) of a chat completion."""
    choices = completion.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    calls = [call_item(c) for c in message.get("tool_calls") or ()]
    output = [message_item(new_id("msg"), text)] if text or not calls else []
    output.extend(calls)
    response = turn.response(
        "completed", output, completion.get("usage"), choice.get("finish_reason")
    )
    return response, assistant_message(text, calls)


def batch_request(body: bytes) -> tuple[ResponsesRequest, bytes]:
    """A Batch API line's /v1/responses body: (the request, its chat completion body). Batch
    requests are stateless: previous_response_id is refused, nothing is stored."""
    req = parse_request(body)
    if req.previous_response_id is not None:
        raise bad_request(
            "previous_response_id: batch requests are stateless (chain turns interactively)",
            param="previous_response_id",
        )
    new, _ = input_messages(req.input)
    return req, msgspec.json.encode(chat_body(req, [], new))


def batch_response(req: ResponsesRequest, completion: bytes) -> bytes:
    """The Response object of a batch line from its chat completion's answer."""
    response, _ = completed(Turn(req, None, [], [], []), _any.decode(completion))
    response["store"] = False
    return msgspec.json.encode(response)


# -- the stream ------------------------------------------------------------------------------


def _event(kind: str, seq: int, payload: dict[str, Any]) -> bytes:
    data = msgspec.json.encode({"type": kind, "sequence_number": seq, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """The decoded `data:` payloads of an SSE byte stream (`[DONE]` skipped)."""

    async def events() -> AsyncIterator[Any]:
        pending = b""
        async for chunk in chunks:
            pending += chunk
            *complete, pending = pending.split(b"\n\n")
            for event in complete:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue  # read on to the end: the relay counts a cut stream as 499
                    try:
                        yield _any.decode(data)
                    except msgspec.DecodeError:
                        continue

    return events()


class _Stream:
    """The Responses event stream of a streamed chat completion."""

    def __init__(self, api: ResponsesAPI, turn: Turn) -> None:
        self.api = api
        self.turn = turn
        self.seq = 0
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.item_id = new_id("msg")
        self.opened = False

    def event(self, kind: str, **payload: Any) -> bytes:
        out = _event(kind, self.seq, payload)
        self.seq += 1
        return out

    async def run(self, upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        turn = self.turn
        yield self.event("response.created", response=turn.response("in_progress", [], None))
        yield self.event("response.in_progress", response=turn.response("in_progress", [], None))
        try:
            async for chunk in sse_data(upstream):
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    yield self.failed(chunk["error"])
                    return
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    for out in self.choice(choice):
                        yield out
            for out in await self.finished():
                yield out
        finally:
            close = getattr(upstream, "aclose", None)
            if close is not None:
                await close()

    def choice(self, choice: dict[str, Any]) -> list[bytes]:
        out = []
        delta = choice.get("delta") or {}
        if text := delta.get("content"):
            if not self.opened:
                out.extend(self.open_message())
            self.text.append(text)
            out.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        for call in delta.get("tool_calls") or ():
            index = call.get("index", 0)
            known = self.calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            function = call.get("function") or {}
            known["id"] = call.get("id") or known["id"]
            known["name"] = function.get("name") or known["name"]
            known["arguments"] += function.get("arguments") or ""
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        return out

    def open_message(self) -> list[bytes]:
        self.opened = True
        item = message_item(self.item_id, "", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    async def finished(self) -> list[bytes]:
        out: list[bytes] = []
        text = "".join(self.text)
        calls = [
            call_item({"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}})
            for _, c in sorted(self.calls.items())
        ]
        output: list[dict[str, Any]] = []
        if text or not calls:
            if not self.opened:
                out.extend(self.open_message())
            item = message_item(self.item_id, text)
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self.event(
                    "response.content_part.done",
                    item_id=self.item_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                )
            )
            out.append(self.event("response.output_item.done", output_index=0, item=item))
            output.append(item)
        for call in calls:
            index = len(output)
            added = {**call, "arguments": "", "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=index, item=added))
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=call["id"],
                    output_index=index,
                    delta=call["arguments"],
                )
            )
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=call["id"],
                    output_index=index,
                    arguments=call["arguments"],
                )
            )
            out.append(self.event("response.output_item.done", output_index=index, item=call))
            output.append(call)
        turn = self.turn
        response = turn.response("completed", output, self.usage, self.finish)
        if turn.req.store:
            # On disk before the client sees it complete: its next turn may chain at once.
            await self.api.save(turn.record(response, assistant_message(text, calls)))
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=response))
        return out

    def failed(self, error: Any) -> bytes:
        error = error if isinstance(error, dict) else {"message": str(error)}
        code = str(error.get("code") or "server_error")
        message = str(error.get("message") or "The engine failed mid-stream")
        failure = {"code": code, "message": message}
        self.api.failures.inc()
        return self.event("error", code=code, message=message, param=None) + self.event(
            "response.failed", response=self.turn.response("failed", [], self.usage, None, failure)
        )


# -- the endpoints ---------------------------------------------------------------------------


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"No response with id '{response_id[:256]}' (unknown, another tenant's, deleted, or "
        "past gateway.responses_retention_s)",
        param=param,
        code="response_not_found",
    )


class ResponsesAPI:
    def __init__(self, gateway: Gateway, store: ResponseStore) -> None:
        self.gateway = gateway
        self.store = store
        registry = gateway.metrics_registry
        self.stored = Counter(
            "hpcserve_gateway_responses_stored",
            "Responses written to the gateway's response store (store=true)",
            registry=registry,
        )
        self.chained = Counter(
            "hpcserve_gateway_responses_chained",
            "Responses requests naming a previous_response_id, by whether it was found",
            ["outcome"],
            registry=registry,
        )
        self.failures = Counter(
            "hpcserve_gateway_responses_stream_failures",
            "Streamed responses that ended with response.failed (the engine failed mid-stream)",
            registry=registry,
        )
        size = Gauge(
            "hpcserve_gateway_responses_in_store",
            "Rows in the response store (all tenants, before retention pruning)",
            registry=registry,
        )
        size.set_function(self.store.count)

    async def save(self, record: StoredResponse) -> None:
        await asyncio.to_thread(self.store.put, record)
        self.stored.inc()

    async def create(self, gateway: Gateway, request: Request) -> Response:
        tenant = gateway.keys.tenant_for(request.headers.get("authorization"))
        request.scope["hpcserve.tenant"] = tenant.name
        request.scope["hpcserve.key"] = tenant
        req = parse_request(await gateway.read_body(request))
        request.scope["hpcserve.asked"] = req.model
        new, stored_input = input_messages(req.input)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = await asyncio.to_thread(
                self.store.get, tenant.name, req.previous_response_id
            )
            self.chained.labels("found" if previous else "not_found").inc()
            if previous is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = previous.history
        turn = Turn(req, tenant, history, new, stored_input)
        chat = chat_body(req, history, new)
        body = msgspec.json.encode(chat)
        parsed = validate.parse(CHAT, body)
        if req.prompt_cache_key and "x-session-id" not in request.headers:
            parsed.user = parsed.user or req.prompt_cache_key[:256]  # type: ignore[union-attr]
        upstream = await gateway.relay_parsed(request, CHAT, tenant, parsed, body)
        if upstream.status_code != 200:
            return upstream  # an OpenAI-shaped error already
        if isinstance(upstream, StreamingResponse):
            stream = _Stream(self, turn)
            return StreamingResponse(
                stream.run(upstream.body_iterator),  # type: ignore[arg-type]
                media_type="text/event-stream",
                background=upstream.background,
            )
        try:
            completion = _any.decode(upstream.body)
        except msgspec.DecodeError:
            raise errors.APIError(
                502, "The engine's answer is not JSON", type="upstream_error"
            ) from None
        response, assistant = completed(turn, completion)
        if req.store:
            await self.save(turn.record(response, assistant))
        return JSONResponse(response)

    async def _stored(self, gateway: Gateway, request: Request) -> tuple[Tenant, str]:
        tenant = gateway.keys.tenant_for(request.headers.get("authorization"))
        request.scope["hpcserve.tenant"] = tenant.name
        request.scope["hpcserve.key"] = tenant
        return tenant, request.path_params["response_id"]

    async def retrieve(self, gateway: Gateway, request: Request) -> Response:
        tenant, response_id = await self._stored(gateway, request)
        found = await asyncio.to_thread(self.store.get, tenant.name, response_id)
        if found is None:
            raise not_found(response_id)
        return JSONResponse(found.response)

    async def delete(self, gateway: Gateway, request: Request) -> Response:
        tenant, response_id = await self._stored(gateway, request)
        if not await asyncio.to_thread(self.store.delete, tenant.name, response_id):
            raise not_found(response_id)
        log.info("stored response %s deleted by tenant %s", response_id, tenant.name)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, gateway: Gateway, request: Request) -> Response:
        tenant, response_id = await self._stored(gateway, request)
        if await asyncio.to_thread(self.store.get, tenant.name, response_id) is None:
            raise not_found(response_id)
        raise bad_request(
            "Only background responses can be cancelled, and this gateway serves none: "
            "the response is complete",
            param="response_id",
        )

    async def input_items(self, gateway: Gateway, request: Request) -> Response:
        tenant, response_id = await self._stored(gateway, request)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order: expected 'asc' or 'desc'", param="order")
        limit_text = query.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise bad_request("limit: expected an integer from 1 to 100", param="limit")
        found = await asyncio.to_thread(self.store.get, tenant.name, response_id)
        if found is None:
            raise not_found(response_id)
        items = found.input_items if order == "asc" else found.input_items[::-1]
        if after := query.get("after"):
            ids = [item.get("id") for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[: int(limit_text)]
        return JSONResponse({
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        })  # fmt: skip


Wrap = Callable[[Any, str, Any], Any]


def responses_routes(gateway: Gateway, wrap: Wrap) -> list[Route]:
    """The Responses API's routes, each wrapped like the gateway's own (errors, metrics)."""
    root = gateway.config.responses_dir
    if not root:
        log.warning(
            "no gateway.responses_dir: stored responses are kept in this process's memory "
            "only (the `hpcserve gateway` command always sets one)"
        )
    store = ResponseStore(Path(root) if root else None, gateway.config.responses_retention_s)
    api = ResponsesAPI(gateway, store)
    one = "/v1/responses/{response_id}"
    return [
        Route("/v1/responses", wrap(gateway, "responses", api.create), methods=["POST"]),
        Route(one, wrap(gateway, "responses", api.retrieve), methods=["GET"]),
        Route(one, wrap(gateway, "responses", api.delete), methods=["DELETE"]),
        Route(one + "/cancel", wrap(gateway, "responses", api.cancel), methods=["POST"]),
        Route(one + "/input_items", wrap(gateway, "responses", api.input_items), methods=["GET"]),
    ]
