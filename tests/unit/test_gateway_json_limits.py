"""The classes of body that decoders and the engine cannot take (gateway/json_limits.py), and
every error body in OpenAI's shape (gateway/errors.py): table tests on the pure functions."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcserve.gateway import json_limits, json_scan, validate
from hpcserve.gateway.errors import (
    TYPES,
    APIError,
    openai_error_body,
    openai_error_event,
    type_for,
)

CHAT = "/v1/chat/completions"
BASE = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]'


def refused(endpoint: str, body: bytes) -> APIError:
    with pytest.raises(APIError) as err:
        validate.parse(endpoint, body)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        (b'"top_k": 1000000000000000000000000000000', "top_k", "out of range"),
        (b'"top_k": 18446744073709551616', "top_k", "signed 64-bit int"),
        (b'"stream_interval": 9223372036854775808', "stream_interval", "out of range"),
        (b'"vllm_xargs": {"a": [1, -9223372036854775809]}', "vllm_xargs.a[1]", "out of range"),
        (b'"seed": 1' + b"0" * 5000, "seed", "more than 40 digits"),
        (b'"min_p": 1e400, "x": 1234567890123456789012', "min_p", "64-bit float"),
        (b'"stop": "a\\ud800b"', "stop", "lone UTF-16 surrogate"),
        (b'"stop": ["ok", "\\udc00"]', "stop[1]", "lone UTF-16 surrogate"),
        (b'"bad_words": ["x\\ud800"]', "bad_words[0]", "lone UTF-16 surrogate"),
        (b'"request_id": "\\ud800\\u0041"', "request_id", "lone UTF-16 surrogate"),
        (b'"\\ud800": 1', "\\ud800", "lone UTF-16 surrogate"),  # a key: escaped in the answer
        (b'"temperature": NaN', "temperature", "NaN is not a JSON number"),
        (b'"top_p": -Infinity', "top_p", "Infinity is not a JSON number"),
        (b'"best_of": ' + b"[" * 300 + b"]" * 300, None, "the limit is 128 levels"),
        (b'"x": ' + b'{"a":' * 2000 + b"1" + b"}" * 2000, None, "2001 levels deep"),
    ],
)
def test_each_class_is_a_400_naming_the_field(extra: bytes, param: str | None, needle: str) -> None:
    err = refused(CHAT, BASE + b", " + extra + b"}")
    assert needle in err.message and err.param == param
    body = msgspec.json.decode(err.response().body)  # encodable, whatever the input held
    assert set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "extra",
    [
        b'"seed": 9223372036854775807, "priority": -9223372036854775808',
        b'"stop": "\\ud83d\\ude00 an emoji as a surrogate pair"',
        b'"prompt": "1234567890123456789012345 digits in a string"',
        b'"user": "' + b"[" * 500 + b'"',  # brackets in a string are not nesting
        b'"temperature": 1e-300',
    ],
)
def test_lookalikes_pass(extra: bytes) -> None:
    validate.parse(CHAT, BASE + b", " + extra + b"}")


def test_every_endpoint_bounds_its_body() -> None:
    deep = b"[" * 400 + b"]" * 400
    for endpoint, body in [
        ("/v1/completions", b'{"model": "m", "prompt": "x", "best_of": ' + deep + b"}"),
        ("/v1/embeddings", b'{"model": "m", "input": "x", "dimensions": ' + deep + b"}"),
        ("/v1/rerank", b'{"model": "m", "query": "q", "documents": ["d"], "top_n": ' + deep + b"}"),
        ("/v1/score", b'{"model": "m", "text_1": "a", "text_2": "b", "x": ' + deep + b"}"),
    ]:
        assert "levels deep" in refused(endpoint, body).message


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.recursive(st.none() | st.integers(), lambda c: st.lists(c, max_size=3), max_leaves=40))
def test_nesting_depth_matches_a_decoder(value: object) -> None:
    text = json.dumps({"a": value, "s": "[[[{{{"}).encode()

    def depth(v: object) -> int:
        return 1 + max(map(depth, v), default=0) if isinstance(v, list) else 0

    assert json_limits.nesting_depth(text) == 1 + depth(value)


@pytest.mark.parametrize(
    ("status", "payload", "type_", "code", "needle"),
    [
        (500, b'{"error":{"message":"","type":"InternalServerError","param":null,"code":500}}',
         "server_error", "engine_error", "gave no detail"),
        (500, b'{"error":{"message":"Internal server error","type":"InternalServerError",'
              b'"param":null,"code":500}}', "server_error", "engine_error", "Internal server error"),
        (400, b'{"error":{"message":"top_k must be","type":"BadRequestError","param":"top_k",'
              b'"code":400}}', "invalid_request_error", None, "top_k must be"),
        (404, b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError",'
              b'"param":"model","code":404}}', "not_found_error", None, "does not exist"),
        (400, b'{"detail":"There was an error parsing the body"}', "invalid_request_error", None,
         "error parsing the body"),
        (422, b'{"detail":[{"loc":["body","n"],"msg":"bad"}]}', "invalid_request_error", None,
         "bad"),
        (502, b"<html>Bad Gateway</html>", "server_error", "engine_error", "Bad Gateway"),
        (503, b"", "server_error", "engine_error", "gave no detail"),
    ],
)  # fmt: skip
def test_engine_errors_are_rewritten_in_openai_shape(
    status: int, payload: bytes, type_: str, code: str | None, needle: str
) -> None:
    error = msgspec.json.decode(openai_error_body(status, payload, "rid-1"))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["code"] == code
    assert needle in error["message"] and error["message"].strip()
    assert ("rid-1" in error["message"]) is (status >= 500)


def test_an_error_event_in_a_stream_is_rewritten() -> None:
    payload = (
        b'{"error": {"message": "", "type": "InternalServerError", "param": null, "code": 500}}'
    )
    event = openai_error_event(payload, "rid-2")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    error = msgspec.json.decode(event[6:])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "rid-2" in error["message"]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 409, 413, 422, 429, 500, 502, 503])
def test_every_status_has_a_type_of_the_vocabulary(status: int) -> None:
    assert type_for(status, "SomethingElse") in TYPES
    assert type_for(status, "rate_limit_error") == "rate_limit_error"  # kept when known


VLLM_500 = b'{"error":{"message":"","type":"InternalServerError","param":null,"code":500}}'


def test_an_engine_500_through_the_relay_is_openai_shaped_and_done_as_500() -> None:
    from tests.unit.test_gateway_relay import engine, fixed, forward

    head = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
    raw = head + b"Content-Length: %d\r\n\r\n%s" % (len(VLLM_500), VLLM_500)

    async def scenario():  # type: ignore[no-untyped-def]
        async with engine(fixed(raw)) as url:
            return await forward(url)

    response, body, seen = asyncio.run(scenario())
    error = json.loads(body)["error"]
    assert response.status_code == 500 and seen[-1] == ("done", 500)
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "gave no detail" in error["message"]


def test_an_error_event_from_the_engine_mid_stream_is_rewritten_and_ends_as_failed() -> None:
    from tests.unit.test_gateway_relay import (
        CHOICE,
        SSE_HEAD,
        chunked,
        engine,
        events,
        fixed,
        forward,
    )

    (first,) = events({"id": "c", "choices": [CHOICE]})
    failure = b"data: " + VLLM_500.replace(b":", b": ") + b"\n\ndata: [DONE]\n\n"

    async def scenario():  # type: ignore[no-untyped-def]
        async with engine(fixed(SSE_HEAD + chunked(first, failure))) as url:
            return await forward(url, stream=True)

    _, body, seen = asyncio.run(scenario())
    lines = [line for line in body.split(b"\n\n") if line]
    assert lines[0] == first.rstrip() and lines[-1] == b"data: [DONE]"
    error = json.loads(lines[1][6:])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert seen[-1] == ("done", 500)  # counted as an engine failure, not a success


def test_a_stream_that_opens_with_an_error_is_answered_as_that_error() -> None:
    from tests.unit.test_gateway_relay import SSE_HEAD, chunked, engine, events, fixed, forward

    (role,) = events({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                     "content": ""}}]})  # fmt: skip
    refusal = b'{"error": {"message": "bad_words entries must tokenize", "type": '
    refusal += b'"BadRequestError", "param": "bad_words", "code": 400}}'
    stream = role + b"data: " + refusal + b"\n\ndata: [DONE]\n\n"

    async def scenario():  # type: ignore[no-untyped-def]
        async with engine(fixed(SSE_HEAD + chunked(stream))) as url:
            return await forward(url, stream=True)

    response, body, seen = asyncio.run(scenario())
    assert response.status_code == 400 and seen[-1] == ("done", 400)
    assert json.loads(body)["error"] == {
        "message": "bad_words entries must tokenize",
        "type": "invalid_request_error",
        "param": "bad_words",
        "code": None,
    }


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b'{"a": "[[[\\"[[[", "b": [1]}', 2),  # an escaped quote inside a string
        (b'{"a\\\\": [[1]], "b": "\\\\\\"[["}', 3),  # escaped backslashes, then a quote
        (b'["]]]]", [[], {"x": "{{{{"}]]', 3),
        (b"", 0),
    ],
)
def test_brackets_inside_strings_do_not_nest(text: bytes, depth: int) -> None:
    assert json_limits.nesting_depth(text) == depth
    assert json_scan.scan(text) == (depth, False)


# Text that tries the compiled pass's string skipping: escapes (also at a string's end),
# quotes and brackets inside strings, long digit runs inside strings and out.
_TRICKY_TEXT = st.text(
    st.sampled_from(['"', "\\", "[", "]", "{", "}", "9", "0", " ", "\n", "é", "\U0001f600"]),
    max_size=40,
)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TRICKY_TEXT,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(_TRICKY_TEXT, children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(_JSON_VALUES, st.integers(min_value=0, max_value=10**30))
def test_the_compiled_scan_agrees_with_the_reference(value: object, number: int) -> None:
    for body in (
        json.dumps(value).encode(),
        json.dumps({"v": value, "n": number}).encode(),
        json.dumps([value, str(number)], ensure_ascii=False).encode(),
    ):
        assert json_scan.scan(body) == json_limits.scan_reference(body), body


@pytest.mark.parametrize(
    ("text", "scanned"),
    [
        (b'"' + b"1" * 30 + b'"', (0, False)),  # a long run inside a string: no closer look
        (b'{"a": "x", "n": ' + b"1" * 19 + b"}", (1, True)),
        (b"[" + b"1" * 18 + b"]", (1, False)),
        (b"-1234567890.1234567890123456789", (0, True)),  # a float's digits: looked at closely
        (b'["abc\\', (1, False)),  # a string cut inside an escape
        (b'["abc', (1, False)),  # a string never closed
        (b'"\\"[[', (0, False)),  # an escaped quote keeps the string open
        (b"]]]}", (0, False)),
        (bytearray(b"[[1]]"), (2, False)),
        (memoryview(b"[[1]]"), (2, False)),
    ],
)
def test_the_compiled_scan_on_edges(text: bytes, scanned: tuple[int, bool]) -> None:
    assert json_scan.scan(text) == scanned


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":"' + b"\\n" * 50_000 + b'"}',  # escape after escape in one string
        b'{"a":"' + b'\\"' * 50_000 + b'"}',  # escaped quotes: each takes the quote found
        b'{"a":"' + b"a\\\\" * 30_000 + b'"}',  # escaped backslashes
        b'"",' * 30_000,
        b"[" * 100_000,
        b"[" + b"1" * 100_000 + b"]",
    ],
    ids=["escapes", "escaped-quotes", "escaped-backslashes", "strings", "brackets", "digits"],
)
def test_the_compiled_scan_agrees_on_adversarial_bodies(body: bytes) -> None:
    assert json_scan.scan(body) == json_limits.scan_reference(body)


def test_the_compiled_scan_takes_only_bytes_like_bodies() -> None:
    with pytest.raises(TypeError):
        json_scan.scan("[[1]]")


def test_a_body_too_big_to_walk_is_still_checked_for_integers() -> None:
    filler = b'"' + b"x" * json_limits.MAX_WALKED_BYTES + b'"'
    fine = b'{"model": "m", "prompt": "x", "f": ' + filler + b', "x": 9223372036854775807}'
    validate.parse("/v1/completions", fine)
    bad = fine.replace(b"9223372036854775807", b"9223372036854775808")
    assert "outside a signed 64-bit int" in refused("/v1/completions", bad).message
    floats = fine.replace(b"9223372036854775807", b"92233720368547758080.5")
    validate.parse("/v1/completions", floats)


def test_a_streamed_completion_with_echo_logprobs_and_n_is_refused() -> None:
    # Found by the fuzzer against vLLM 0.32.0: a KeyError mid-stream, a 500 event.
    body = b'{"model": "m", "prompt": "0", "stream": true, "echo": true, "logprobs": 0, "n": 2}'
    assert refused("/v1/completions", body).param == "echo"
    validate.parse("/v1/completions", body.replace(b'"n": 2', b'"n": 1'))
    validate.parse("/v1/completions", body.replace(b'"stream": true', b'"stream": false'))


def test_a_stale_json_scan_build_names_the_fix() -> None:
    code = (
        "import sys, types\n"
        "sys.modules['hpcserve.gateway._json_scan'] = types.ModuleType('stale')\n"
        "import hpcserve.gateway.json_limits\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("ImportError")
    assert "_json_scan is a stale build (API None, this code needs 2)" in result.stderr
