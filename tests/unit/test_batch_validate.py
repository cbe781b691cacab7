"""The batch input file validator: a table of files and the exact problems reported."""

from __future__ import annotations

import json

import pytest

from hpcserve.gateway.batch.validate import (
    MAX_REPORTED,
    FileSummary,
    InvalidBatchFile,
    split_lines,
    validate_batch_file,
)

GOOD = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}


def line(**changes: object) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def errors_of(*lines: bytes, max_lines: int = 100) -> list[str]:
    with pytest.raises(InvalidBatchFile) as caught:
        validate_batch_file([b"\n".join(lines) + b"\n"], max_lines=max_lines)
    return [str(e) for e in caught.value.errors]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ((b"{nope",), ["line 1: not a JSON object: "]),
        ((b"[1, 2]",), ["line 1: not a JSON object: "]),
        ((line(), b"", line(custom_id="b")), ["line 2: empty line"]),
        ((json.dumps({k: v for k, v in GOOD.items() if k != "custom_id"}).encode(),),
         ["line 1: 'custom_id' is missing"]),
        ((line(custom_id=7),), ["line 1: 'custom_id' must be a non-empty string, got 7"]),
        ((line(custom_id=""),), ["line 1: 'custom_id' must be a non-empty string, got ''"]),
        ((line(custom_id="x" * 513),), ["line 1: 'custom_id' is longer than 512 characters"]),
        ((line(method="GET"),), ["line 1: 'method' must be 'POST', got 'GET'"]),
        ((line(url="/v1/images"),), ["line 1: 'url' must be one of /v1/chat/completions"]),
        ((line(body=[1]),), ["line 1: 'body' must be a JSON object, got list"]),
        ((line(body={"messages": []}),), ["line 1: 'body.model' is required"]),
        ((line(body={"model": "m", "stream": True}),), ["line 1: 'body.stream' must be false"]),
        ((line(), line(custom_id="b"), line()),
         ["line 3: 'custom_id' 'a' is already used by line 1"]),
        ((line(), line(method="PUT", custom_id="b"), line(custom_id="c", url="/x")),
         ["line 2: 'method' must be 'POST'", "line 3: 'url' must be one of"]),
    ],
)  # fmt: skip
def test_each_problem_names_its_line(lines: tuple[bytes, ...], expected: list[str]) -> None:
    found = errors_of(*lines)
    assert len(found) == len(expected), found
    for message, start in zip(found, expected, strict=True):
        assert message.startswith(start), (message, start)


def test_a_valid_file_is_summarised() -> None:
    data = b"\n".join(
        [
            line(),
            line(custom_id="b", body={"model": "n", "input": "x"}, url="/v1/embeddings"),
            line(custom_id="c"),
        ]
    )
    summary = validate_batch_file([data], max_lines=3)  # no final newline: still three lines
    assert summary == FileSummary(
        lines=3, urls=["/v1/chat/completions", "/v1/embeddings"], models=["m", "n"]
    )


def test_limits_and_empty_files() -> None:
    assert errors_of(line(), line(custom_id="b"), max_lines=1) == [
        "line 2: the file has more than 1 lines"
    ]
    with pytest.raises(InvalidBatchFile, match="line 1: the file is empty"):
        validate_batch_file([b""], max_lines=10)


def test_reports_stop_after_a_bounded_number() -> None:
    bad = [b"{" for _ in range(MAX_REPORTED + 5)]
    with pytest.raises(InvalidBatchFile) as caught:
        validate_batch_file([b"\n".join(bad)], max_lines=1000)
    assert len(caught.value.errors) == MAX_REPORTED
    assert caught.value.more and str(caught.value).endswith("(more errors not shown)")


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"a\nb\n"], [(1, b"a"), (2, b"b")]),
        ([b"a\r\nb"], [(1, b"a"), (2, b"b")]),
        ([b"a", b"b\nc", b"\n"], [(1, b"ab"), (2, b"c")]),
        ([b"\n"], [(1, b"")]),
        ([], []),
    ],
)
def test_split_lines_across_chunks(chunks: list[bytes], expected: list[tuple[int, bytes]]) -> None:
    assert list(split_lines(chunks)) == expected


def test_responses_lines_are_checked_as_the_responses_api_checks_them() -> None:
    good = line(url="/v1/responses", body={"model": "m", "input": "hi", "max_output_tokens": 5})
    assert validate_batch_file([good], max_lines=1).urls == ["/v1/responses"]
    assert errors_of(
        line(url="/v1/responses", body={"model": "m", "input": "x", "previous_response_id": "r"}),
        line(custom_id="b", url="/v1/responses", body={"model": "m", "input": [{"type": "x"}]}),
    ) == [
        "line 1: 'body': previous_response_id: batch requests are stateless (chain turns "
        "interactively)",
        "line 2: 'body': input[0].type: expected message, function_call or "
        "function_call_output, got 'x'",
    ]
