"""The batch store on a real SQLite file and directory: results stored once, counted once,
output files rebuilt identically, tenants scoped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcserve.gateway.batch.store import (
    BatchRecord,
    BatchStore,
    Conflict,
    NotFound,
    Result,
    new_id,
)
from hpcserve.gateway.batch.validate import validate_batch_file


def add_input(store: BatchStore, tenant: str, count: int) -> str:
    data = b"".join(
        json.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": "p"}}
        ).encode() + b"\n"
        for i in range(count)
    )  # fmt: skip
    temp = store.temp_path()
    temp.write_bytes(data)
    summary = validate_batch_file([data], max_lines=1000)
    return store.add_file(
        temp, tenant=tenant, filename="in.jsonl", purpose="batch", summary=summary
    ).id


def add_batch(store: BatchStore, tenant: str, count: int) -> BatchRecord:
    file_id = add_input(store, tenant, count)
    return store.create_batch(
        BatchRecord(
            id=new_id("batch_"),
            tenant=tenant,
            endpoint="/v1/completions",
            input_file_id=file_id,
            completion_window="24h",
            status="in_progress",
            created_at=1,
            expires_at=2,
            total=count,
        )
    )


def ok(line: int, tokens: int = 3) -> Result:
    body = json.dumps({"usage": {"prompt_tokens": tokens, "completion_tokens": 1}}).encode()
    return Result(
        line, f"c{line - 1}", 200, f"req_{line}", body, input_tokens=tokens, output_tokens=1
    )


def test_a_result_is_stored_and_counted_once(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = add_batch(store, "t", 3)
    assert store.record_results(batch.id, [ok(1), ok(2)]) == 2
    assert store.record_results(batch.id, [ok(2), ok(3)]) == 1  # line 2 again: ignored
    failed = Result(3, "c2", 500, "req_x", b"{}", error_code="x")
    assert store.record_results(batch.id, [failed]) == 0
    record = store.get_batch(batch.id)
    assert (record.completed, record.failed, record.input_tokens) == (3, 0, 9)
    assert store.done_lines(batch.id) == {1, 2, 3}
    store.close()
    # ... and is still there for the next process.
    again = BatchStore(tmp_path)
    assert again.get_batch(batch.id).completed == 3


def test_finish_writes_each_line_once_and_can_be_repeated(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = add_batch(store, "t", 4)
    store.record_results(
        batch.id,
        [ok(1), Result(2, "c1", 400, "req_2", b'{"error": {"message": "bad"}}'),
         Result(3, "c2", 0, "req_3", None, error_code="replica_failed", error_message="gone")],
    )  # fmt: skip
    first = store.finish(batch, status="expired", unfinished_code="batch_expired")
    again = store.finish(batch, status="expired", unfinished_code="batch_expired")
    assert (again.output_file_id, again.error_file_id) == (
        first.output_file_id,
        first.error_file_id,
    )
    assert first.status == "expired" and first.expired_at
    output = [json.loads(x) for x in store.path_of(first.output_file_id).read_bytes().splitlines()]
    errors = [json.loads(x) for x in store.path_of(first.error_file_id).read_bytes().splitlines()]
    assert [o["custom_id"] for o in output] == ["c0"]
    assert output[0]["response"]["body"]["usage"]["prompt_tokens"] == 3
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"]) for e in errors] == [
        ("c1", 400),
        ("c2", None),
        ("c3", None),
    ]
    assert errors[1]["error"] == {"code": "replica_failed", "message": "gone"}
    assert errors[2]["error"]["code"] == "batch_expired"
    assert store.get_file(first.output_file_id, "t").purpose == "batch_output"
    assert not list(tmp_path.glob("files/.upload-*")), "no temporary file left"


def test_tenants_are_scoped_and_pages_follow_the_cursor(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    a1, b1, a2 = add_batch(store, "a", 1), add_batch(store, "b", 1), add_batch(store, "a", 1)
    with pytest.raises(NotFound):
        store.get_batch(a1.id, "b")
    with pytest.raises(NotFound):
        store.get_file(a1.input_file_id, "b")
    assert store.get_batch(a1.id, None).id == a1.id
    page = store.list_batches("a", limit=1)
    assert [x.id for x in page.items] == [a2.id] and page.has_more
    page = store.list_batches("a", after=a2.id, limit=1)
    assert [x.id for x in page.items] == [a1.id] and not page.has_more
    assert [x.id for x in store.list_batches(None).items] == [a2.id, b1.id, a1.id]
    assert len(store.list_files("b").items) == 1


def test_cancel_and_delete_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    batch = add_batch(store, "t", 1)
    with pytest.raises(Conflict, match="is the input of batch"):
        store.delete_file(batch.input_file_id, "t")
    with pytest.raises(NotFound):
        store.request_cancel(batch.id, "other")
    cancelling = store.request_cancel(batch.id, "t")
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    assert store.request_cancel(batch.id, "t").status == "cancelling"
    done = store.finish(cancelling, status="cancelled", unfinished_code="batch_cancelled")
    assert store.request_cancel(done.id, None).status == "cancelled"  # asking again is fine
    other = store.update_batch(add_batch(store, "t", 1).id, status="completed")
    with pytest.raises(Conflict, match="status 'completed'"):
        store.request_cancel(other.id, None)
    store.delete_file(batch.input_file_id, "t")
    assert not store.path_of(batch.input_file_id).exists()
