"""Check a batch input file (JSONL) line by line: a pure function over its lines.

Each line must be a JSON object ``{"custom_id", "method": "POST", "url", "body"}`` with
``custom_id`` unique within the file, ``url`` an endpoint the Batch API runs and ``body`` an
object naming a ``model``. Every problem is reported with its 1-based line number, up to
`MAX_REPORTED` of them, so a client can fix a file in one round trip.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from hpcserve.contracts.batch_backlog import FileSummary
from hpcserve.gateway.errors import APIError
from hpcserve.gateway.json_limits import check_body
from hpcserve.gateway.responses import batch_request

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/responses",  # run as a chat completion (gateway/responses.py batch_request)
)
MAX_REPORTED = 20
MAX_CUSTOM_ID_CHARS = 512


class LineError(msgspec.Struct, frozen=True):
    line: int
    problem: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.problem}"


class InvalidBatchFile(ValueError):
    def __init__(self, errors: list[LineError], *, more: bool = False) -> None:
        self.errors = errors
        self.more = more
        shown = "; ".join(str(e) for e in errors)
        super().__init__(shown + ("; (more errors not shown)" if more else ""))


class RequestLine(msgspec.Struct, frozen=True):
    """One parsed input line; `body` stays the bytes the client wrote, forwarded as they are."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class _Line(msgspec.Struct):
    custom_id: Any = None
    method: Any = None
    url: Any = None
    body: Any = None


_line_decoder = msgspec.json.Decoder(_Line)
request_line_decoder = msgspec.json.Decoder(RequestLine)


def split_lines(data: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its newline) for chunks of a file; the empty
    string after a final newline is not a line."""
    number = 0
    pending = b""
    for chunk in data:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            number += 1
            yield number, line.removesuffix(b"\r")
    if pending:
        yield number + 1, pending.removesuffix(b"\r")


def _check_line(number: int, raw: bytes) -> tuple[str, str, str] | str:
    """(custom_id, url, model) of a good line, or what is wrong with it."""
    if not raw.strip():
        return "empty line (every line must be one JSON request object)"
    try:
        check_body(raw)  # nesting depth, 64-bit integers, lone surrogates (gateway/json_limits)
    except APIError as err:
        return err.message
    try:
        line = _line_decoder.decode(raw)
    except msgspec.DecodeError as err:
        return f"not a JSON object: {err}"
    if line.custom_id is None:
        return "'custom_id' is missing"
    if not isinstance(line.custom_id, str) or not line.custom_id:
        return f"'custom_id' must be a non-empty string, got {line.custom_id!r}"
    if len(line.custom_id) > MAX_CUSTOM_ID_CHARS:
        return f"'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} characters"
    if line.method != "POST":
        return f"'method' must be 'POST', got {line.method!r}"
    if line.url not in ENDPOINTS:
        return f"'url' must be one of {', '.join(ENDPOINTS)}; got {line.url!r}"
    if not isinstance(line.body, dict):
        return f"'body' must be a JSON object, got {type(line.body).__name__}"
    model = line.body.get("model")
    if not isinstance(model, str) or not model:
        return "'body.model' is required and must be a non-empty string"
    if line.body.get("stream"):
        return "'body.stream' must be false: batch requests are not streamed"
    if line.url == "/v1/responses":
        try:
            batch_request(msgspec.json.encode(line.body))
        except APIError as err:
            return f"'body': {err.message}"
    return line.custom_id, line.url, model


def validate_batch_file(data: Iterable[bytes], *, max_lines: int) -> FileSummary:
    """A summary of a valid batch file, or InvalidBatchFile naming every bad line."""
    errors: list[LineError] = []
    more = False
    first_use: dict[str, int] = {}
    urls: dict[str, None] = {}
    models: dict[str, None] = {}
    count = 0
    for number, raw in split_lines(data):
        count = number
        if number > max_lines:
            errors.append(LineError(number, f"the file has more than {max_lines} lines"))
            break
        checked = _check_line(number, raw)
        if isinstance(checked, str):
            problem: str | None = checked
        else:
            custom_id, url, model = checked
            earlier = first_use.setdefault(custom_id, number)
            problem = (
                f"'custom_id' {custom_id!r} is already used by line {earlier}"
                if earlier != number
                else None
            )
            urls[url] = None
            models[model] = None
        if problem is not None:
            if len(errors) == MAX_REPORTED:
                more = True
                break
            errors.append(LineError(number, problem))
    if not errors and count == 0:
        errors.append(LineError(1, "the file is empty; a batch needs at least one request"))
    if errors:
        raise InvalidBatchFile(errors, more=more)
    return FileSummary(lines=count, urls=list(urls), models=list(models))
