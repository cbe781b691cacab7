"""Request bodies checked before anything is routed or counted: one typed decode per request.

Each endpoint has a msgspec Struct naming the fields the gateway relies on or that
an engine would reject with a 500 rather than a 400; unknown fields pass through to
vLLM untouched (the body is forwarded as sent). Errors name the field and the bad
value, e.g. ``max_tokens: expected int >= 1, got -5``.

Before the typed decode, gateway/json_limits.py bounds the raw JSON (nesting depth, 64-bit
integers and floats, lone surrogates) for every field, known or not; JSON schemas and
regexes for structured output (response_format, structured_outputs, tools) must be ones the
engine's grammar backend compiles (gateway/schema_check.py). docs/architecture.md lists
what is refused and why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jsonschema
import msgspec

from hpcserve.config import humanize_validation_error
from hpcserve.gateway import json_limits, schema_check
from hpcserve.gateway.errors import APIError, bad_request

PosInt = Annotated[int, msgspec.Meta(ge=1)]
MaxN = 128  # OpenAI's own limit on n
Text = Annotated[str, msgspec.Meta(max_length=1_000_000)]
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


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
    # structural_tag: the deprecated form's structures (each with a schema), or a format tree
    structures: list[Any] | None = None
    format: Any = None


class StructuredOutputs(msgspec.Struct):
    """vLLM's own structured-output constraints (the parts a gateway can check)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None


class FunctionDefinition(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    parameters: dict[str, Any] | None = None


class Tool(msgspec.Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


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
    # vLLM's own limits on it; the gateway sets the salt the engine sees (app.py: the
    # tenant's, derived from this one where the client set it).
    cache_salt: CacheSalt | None = None


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] = []
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[Tool] | None = None


class CompletionRequest(_Sampling):
    prompt: Text | list[Text | int | list[int]] = ""
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


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
    json_limits.check_body(body)
    try:
        if not body.isascii():
            body.decode()  # msgspec skips unknown fields without checking their UTF-8
        request: Request = DECODERS[endpoint].decode(body)
    except msgspec.ValidationError as err:
        raise _validation_error(err, body) from None
    except msgspec.DecodeError as err:
        message, param = json_limits.explain_decode_error(str(err), body)
        raise bad_request(f"Request body is not valid JSON: {message}", param=param) from None
    except UnicodeDecodeError as err:
        raise bad_request(
            f"Request body is not valid UTF-8: byte {err.object[err.start]:#04x} at {err.start}"
        ) from None
    except RecursionError:  # json_limits bounds the depth far below this: belt and braces
        raise bad_request(
            f"Request body nests JSON too deeply (the limit is {json_limits.MAX_DEPTH} levels)"
        ) from None
    salt = getattr(request, "cache_salt", None)
    if salt is not None and any(c in salt for c in _SALT_FORBIDDEN):
        raise bad_request(
            "cache_salt must not contain '@', '/', '\\' or NUL (vLLM's rule)", param="cache_salt"
        )
    if request.stream and endpoint not in STREAMING:
        raise bad_request(f"{endpoint} does not stream: 'stream' must be false", param="stream")
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise bad_request("'messages' is required and must not be empty", param="messages")
        _check_response_format(request.response_format)
        _check_structured_outputs(request.structured_outputs)
        for i, tool in enumerate(request.tools or ()):
            if tool.function.parameters is not None:
                check_json_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    elif isinstance(request, EmbeddingRequest):
        if request.input in ("", []):
            raise bad_request("'input' is required and must not be empty", param="input")
        _check_homogeneous(request.input, "input")
    elif isinstance(request, CompletionRequest):
        if request.prompt in ("", []):
            raise bad_request("'prompt' is required and must not be empty", param="prompt")
        _check_homogeneous(request.prompt, "prompt")
        _check_response_format(request.response_format)
        _check_structured_outputs(request.structured_outputs)
        if request.stream and request.echo and request.logprobs is not None and request.n > 1:
            # vLLM 0.32.0 fails mid-stream on it (KeyError in _create_completion_logprobs),
            # depending on how the choices' first tokens arrive.
            raise bad_request(
                "'echo' with 'logprobs' is not supported on a streamed completion with n > 1 "
                "(stream it with n = 1, or do not stream it)",
                param="echo",
            )
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
    if fmt is not None and fmt.type == "structural_tag":
        _check_tag_schemas(fmt.structures, "response_format.structures")
        _check_tag_schemas(fmt.format, "response_format.format")
    if fmt is None or fmt.type != "json_schema":
        return
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request(
            "response_format.json_schema.schema is required when type is 'json_schema'",
            param="response_format.json_schema.schema",
        )
    check_json_schema(fmt.json_schema.schema, "response_format.json_schema.schema")


def _check_structured_outputs(so: StructuredOutputs | None) -> None:
    if so is None:
        return
    if so.choice is not None and (not so.choice or not all(so.choice)):
        raise bad_request(
            "structured_outputs.choice must be a non-empty list of non-empty strings",
            param="structured_outputs.choice",
        )
    if so.regex is not None:
        schema_check.check_regex(so.regex, "structured_outputs.regex")
    if so.grammar is not None:
        schema_check.check_grammar(so.grammar, "structured_outputs.grammar")
    tag = so.structural_tag
    if isinstance(tag, str):
        try:
            tag = _any.decode(tag)
        except msgspec.DecodeError as err:
            raise bad_request(
                f"structured_outputs.structural_tag is not valid JSON: {err}",
                param="structured_outputs.structural_tag",
            ) from None
    _check_tag_schemas(tag, "structured_outputs.structural_tag")
    schema = so.json
    if isinstance(schema, str):
        if json_limits.nesting_depth(schema.encode()) > schema_check.MAX_DEPTH:
            schema_check.too_deep("structured_outputs.json")
        try:
            schema = _any.decode(schema)
        except msgspec.DecodeError as err:
            raise bad_request(
                f"structured_outputs.json is not valid JSON: {err}",
                param="structured_outputs.json",
            ) from None
    if schema is not None:
        check_json_schema(schema, "structured_outputs.json")


def _check_tag_schemas(tag: Any, param: str) -> None:
    """The JSON schemas inside a structural tag (under "schema" or "json_schema", at any
    depth: vLLM checks the tag's shape, and its engine compiles these with xgrammar)."""
    stack: list[tuple[str, Any]] = [(param, tag)]
    while stack:
        path, node = stack.pop()
        if path.count(".") > schema_check.MAX_DEPTH:
            schema_check.too_deep(param)
        if isinstance(node, dict):
            for key, value in node.items():
                at = f"{path}.{key}"
                if key in ("schema", "json_schema") and isinstance(value, dict | bool):
                    check_json_schema(value, at)
                else:
                    stack.append((at, value))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(node))


def check_json_schema(schema: object, param: str) -> None:
    """A JSON Schema valid by its meta-schema that the engine's grammar backend compiles."""
    schema_check.check_depth(schema, param)
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param} must be a JSON Schema (an object)", param=param)
    schema_check.check_schema(schema, param)  # first: its messages say what the engine lacks
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(x) for x in err.absolute_path) or "(root)"
        raise bad_request(
            f"{param} is not a valid JSON Schema at {json_limits.shown_path(where)}: "
            f"{json_limits.shown_path(err.message, 300)}",
            param=param,
        ) from None
