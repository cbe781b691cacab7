"""Request bodies checked before anything is routed or counted: one typed decode per request.

Each endpoint has a msgspec Struct naming the fields the gateway relies on or that
an engine would reject with a 500 rather than a 400; unknown fields pass through to
vLLM untouched (the body is forwarded as sent). Errors name the field and the bad
value, e.g. ``max_tokens: expected int >= 1, got -5``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jsonschema
import msgspec

from hpcserve.config import humanize_validation_error
from hpcserve.gateway.errors import APIError, bad_request

PosInt = Annotated[int, msgspec.Meta(ge=1)]
MaxN = 128  # OpenAI's own limit on n
Text = Annotated[str, msgspec.Meta(max_length=1_000_000)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class _Sampling(msgspec.Struct):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PosInt | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MaxN)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    user: str | None = None


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] = []
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling):
    prompt: Text | list[Text | int | list[int]] = ""
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    response_format: ResponseFormat | None = None


class EmbeddingRequest(msgspec.Struct):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    input: Text | list[Text | int | list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PosInt | None = None
    stream: bool = False
    user: str | None = None


class RerankRequest(msgspec.Struct):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    query: Text
    documents: list[Text]
    top_n: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stream: bool = False


class ScoreRequest(msgspec.Struct):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    stream: bool = False


Request = ChatRequest | CompletionRequest | EmbeddingRequest | RerankRequest | ScoreRequest

DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "/v1/chat/completions": msgspec.json.Decoder(ChatRequest),
    "/v1/completions": msgspec.json.Decoder(CompletionRequest),
    "/v1/embeddings": msgspec.json.Decoder(EmbeddingRequest),
    "/v1/rerank": msgspec.json.Decoder(RerankRequest),
    "/v1/score": msgspec.json.Decoder(ScoreRequest),
}
_any = msgspec.json.Decoder()
STREAMING = ("/v1/chat/completions", "/v1/completions")


def parse(endpoint: str, body: bytes) -> Request:
    """The typed request, or a 400 APIError naming the field and the problem."""
    try:
        if not body.isascii():
            body.decode()  # msgspec skips unknown fields without checking their UTF-8
        request: Request = DECODERS[endpoint].decode(body)
    except msgspec.ValidationError as err:
        raise _validation_error(err, body) from None
    except msgspec.DecodeError as err:
        raise bad_request(f"Request body is not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise bad_request(
            f"Request body is not valid UTF-8: byte {err.object[err.start]:#04x} at {err.start}"
        ) from None
    if request.stream and endpoint not in STREAMING:
        raise bad_request(f"{endpoint} does not stream: 'stream' must be false", param="stream")
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise bad_request("'messages' is required and must not be empty", param="messages")
        _check_response_format(request.response_format)
    elif isinstance(request, EmbeddingRequest):
        if request.input in ("", []):
            raise bad_request("'input' is required and must not be empty", param="input")
        _check_homogeneous(request.input, "input")
    elif isinstance(request, CompletionRequest):
        if request.prompt in ("", []):
            raise bad_request("'prompt' is required and must not be empty", param="prompt")
        _check_homogeneous(request.prompt, "prompt")
        _check_response_format(request.response_format)
    return request


def _check_homogeneous(value: object, field: str) -> None:
    """A list of strings, of token ids or of token-id lists; not a mix of them."""
    if isinstance(value, list) and len({type(v) for v in value}) > 1:
        raise bad_request(
            f"'{field}' must be a string, a list of strings, a list of token ids or a list "
            "of token-id lists, not a mix",
            param=field,
        )


def _validation_error(err: msgspec.ValidationError, body: bytes) -> APIError:
    text = str(err)
    if text.startswith("Expected `object`") and " - at " not in text:
        return bad_request("Request body is not a JSON object")
    try:
        data = _any.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):
        data = None
    message = humanize_validation_error(err, data)
    path, _, _ = message.partition(":")
    param = None if path.startswith("(") else path
    if message.startswith("(top level): object missing required field"):
        field = text.rpartition("`")[0].rpartition("`")[2]
        return bad_request(f"'{field}' is required", param=field)
    return bad_request(message, param=param)


def _check_response_format(fmt: ResponseFormat | None) -> None:
    if fmt is None or fmt.type != "json_schema":
        return
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request(
            "response_format.json_schema.schema is required when type is 'json_schema'",
            param="response_format.json_schema.schema",
        )
    schema = fmt.json_schema.schema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(x) for x in err.absolute_path) or "(root)"
        raise bad_request(
            f"response_format.json_schema.schema is not a valid JSON Schema at {where}: "
            f"{err.message}",
            param="response_format.json_schema.schema",
        ) from None
