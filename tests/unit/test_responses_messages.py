"""The Responses and Messages APIs' parts that need no engine (issue 27): the response store
(tenants, retention, owner-only files, survival across opens), the translation of both APIs
to chat completions and back, and their event streams from a chat completion's stream."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hpcserve.config import ConfigError, parse_config
from hpcserve.gateway import messages, responses
from hpcserve.gateway.errors import APIError
from hpcserve.gateway.responses_store import ResponseStore, StoredResponse


def record(response_id: str, tenant: str = "a", age_s: float = 0.0) -> StoredResponse:
    return StoredResponse(
        id=response_id,
        tenant=tenant,
        created_at=time.time() - age_s,
        model="m",
        response={"id": response_id, "object": "response"},
        input_items=[{"type": "message", "id": "msg_1", "role": "user", "content": []}],
        history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    )


def test_the_store_keeps_responses_per_tenant_on_disk_owner_only(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses", retention_s=3600)
    store.put(record("resp_1"))
    assert store.get("b", "resp_1") is None, "another tenant's id is not found"
    assert not store.delete("b", "resp_1")
    store.close()
    reopened = ResponseStore(tmp_path / "responses", retention_s=3600)  # a gateway restart
    found = reopened.get("a", "resp_1")
    assert found is not None and found.history[1] == {"role": "assistant", "content": "yo"}
    assert stat.S_IMODE((tmp_path / "responses").stat().st_mode) == 0o700
    for path in (tmp_path / "responses").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert reopened.delete("a", "resp_1")
    assert reopened.get("a", "resp_1") is None


def test_responses_past_retention_are_gone_and_pruned() -> None:
    store = ResponseStore(None, retention_s=60)
    store.put(record("new"))  # the first write prunes; the next ones within PRUNE_EVERY_S not
    store.put(record("old", age_s=120))
    assert store.get("a", "old") is None, "past retention: not found before it is pruned"
    assert not store.delete("a", "old")
    assert store.get("a", "new") is not None
    assert store.count() == 2
    assert store.prune() == 1
    assert store.count() == 1


def test_retention_and_messages_api_settings_are_typed_and_checked() -> None:
    with pytest.raises(ConfigError, match="responses_retention_s"):
        parse_config({"gateway": {"responses_retention_s": 0}})
    with pytest.raises(ConfigError, match="messages_api"):
        parse_config({"pools": [{"name": "p", "model_path": "/m", "messages_api": "yes"}]})
    config = parse_config({"state_dir": "/srv/hpc", "pools": [{"name": "p", "model_path": "/m"}]})
    assert config.responses_dir() == "/srv/hpc/responses"
    assert config.pools[0].messages_api is True


def test_responses_input_becomes_chat_messages_after_the_stored_conversation() -> None:
    req = responses.parse_request(
        json.dumps({
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_text", "text": "b"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "max_output_tokens": 7,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "stream": True,
        }).encode()
    )  # fmt: skip
    new, stored = responses.input_messages(req.input)
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    chat = responses.chat_body(req, history, new)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        *history,
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]  # fmt: skip
    assert chat["max_tokens"] == 7 and chat["stream_options"] == {"include_usage": True}
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "x"
    assert [item["type"] for item in stored] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert all(item["id"] for item in stored)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": ""}, "input"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "input": [{"type": "reasoning"}]}, "input[0].type"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ],
)
def test_bad_responses_requests_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        req = responses.parse_request(json.dumps(body).encode())
        new, _ = responses.input_messages(req.input)
        responses.chat_body(req, [], new)
    assert (err.value.status, err.value.param) == (400, param), err.value.message


async def chat_stream(*events: dict[str, Any]) -> AsyncIterator[bytes]:
    """A chat completion's SSE stream, cut across event boundaries as a socket would."""
    data = b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events)
    data += b"data: [DONE]\n\n"
    for i in range(0, len(data), 7):
        yield data[i : i + 7]


class _Saved:
    def __init__(self) -> None:
        self.records: list[StoredResponse] = []
        self.failures = _Counter()

    async def save(self, record: StoredResponse) -> None:
        self.records.append(record)


class _Counter:
    def inc(self) -> None:
        pass


async def collect(stream: AsyncIterator[bytes]) -> list[dict[str, Any]]:
    out = b"".join([chunk async for chunk in stream])
    events = []
    for block in out.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            event = json.loads(data.removeprefix(b"data: "))
            assert name == b"event: " + event["type"].encode()
            events.append(event)
    return events


def test_a_chat_stream_becomes_the_responses_event_stream_and_is_stored() -> None:
    req = responses.parse_request(b'{"model": "m", "input": "hi"}')
    new, stored = responses.input_messages(req.input)
    turn = responses.Turn(req, _tenant("a"), [], new, stored)
    saved = _Saved()
    upstream = chat_stream(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
    )
    stream = responses._Stream(saved, turn)  # type: ignore[arg-type]
    events = asyncio.run(collect(stream.run(upstream)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens"] == 2
    (saved_record,) = saved.records
    assert saved_record.id == final["id"]
    assert saved_record.history == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
    ]


def test_an_engine_failing_mid_stream_ends_the_response_failed_and_unstored() -> None:
    req = responses.parse_request(b'{"model": "m", "input": "hi"}')
    new, stored = responses.input_messages(req.input)
    turn = responses.Turn(req, _tenant("a"), [], new, stored)
    saved = _Saved()
    upstream = chat_stream(
        {"choices": [{"index": 0, "delta": {"content": "He"}}]},
        {"error": {"message": "boom", "type": "upstream_error", "code": "upstream_failed"}},
    )
    stream = responses._Stream(saved, turn)  # type: ignore[arg-type]
    events = asyncio.run(collect(stream.run(upstream)))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "upstream_failed", "message": "boom"}
    assert saved.records == []


def test_messages_become_chat_and_the_answer_an_anthropic_message() -> None:
    req = messages._decode(
        messages._messages,
        json.dumps({
            "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "sys"}],
            "stop_sequences": ["END"], "top_k": 5, "metadata": {"user_id": "u1"},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "let me look"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                    {"type": "text", "text": "and?"}]},
            ],
        }).encode(),
    )  # fmt: skip
    chat = messages.chat_body(req)
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    assert (chat["stop"], chat["top_k"], chat["user"], chat["tool_choice"]) == (
        ["END"], 5, "u1", "required",
    )  # fmt: skip
    answer = messages.message_of(
        "m",
        {
            "choices": [
                {"message": {"content": "done"}, "finish_reason": "stop", "stop_reason": "END"}
            ],
            "usage": {"prompt_tokens": 11, "completion_tokens": 3},
        },
    )
    assert answer["content"] == [{"type": "text", "text": "done"}]
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", "END")
    assert answer["usage"] == {"input_tokens": 11, "output_tokens": 3}
    called = messages.message_of(
        "m",
        {"choices": [{"message": {"tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": '{"a": 2}'}}]},
            "finish_reason": "tool_calls"}]},
    )  # fmt: skip
    assert called["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {"a": 2}}]
    assert called["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 3, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 3, "messages": [{"role": "system", "content": "x"}]},
         "messages[0].role"),
        ({"model": "m", "max_tokens": 3, "temperature": 1.5,
          "messages": [{"role": "user", "content": "x"}]}, "temperature"),
        ({"model": "m", "max_tokens": 3,
          "messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages[0].content[0].type"),
        ({"model": "m", "max_tokens": 3, "thinking": {"type": "enabled", "budget_tokens": 9},
          "messages": [{"role": "user", "content": "x"}]}, "thinking"),
    ],
)  # fmt: skip
def test_bad_messages_requests_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        messages.chat_body(messages._decode(messages._messages, json.dumps(body).encode()))
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_errors_take_anthropics_shape() -> None:
    response = messages._from_api_error(APIError(429, "slow down", retry_after_s=3))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert json.loads(bytes(response.body)) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    engine = messages._from_openai_body(400, b'{"error": {"message": "too long"}}')
    assert json.loads(bytes(engine.body))["error"] == {
        "type": "invalid_request_error",
        "message": "too long",
    }


def test_a_chat_stream_becomes_anthropics_events() -> None:
    upstream = chat_stream(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}},
    )  # fmt: skip
    events = asyncio.run(collect(messages.anthropic_stream("m", upstream)))
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[5]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    partial = "".join(e["delta"].get("partial_json", "") for e in events[6:8])
    assert json.loads(partial) == {"a": 1}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"] == {"input_tokens": 4, "output_tokens": 6}


def _tenant(name: str) -> Any:
    from hpcserve.config import TenantConfig
    from hpcserve.gateway.auth import Tenant

    return Tenant(name=name, key_id="k", config=TenantConfig(name=name))
