"""Stored records as the OpenAI API shows them (openai.types.FileObject, openai.types.Batch)."""

from __future__ import annotations

from typing import Any

from hpcserve.gateway.batch.store import BatchRecord, FileRecord, Page


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(record: BatchRecord) -> dict[str, Any]:
    errors = None
    if record.errors:
        errors = {
            "object": "list",
            "data": [
                {"code": e.code, "message": e.message, "line": e.line, "param": e.param}
                for e in record.errors
            ],
        }
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": record.total,
            "completed": record.completed,
            "failed": record.failed,
        },
        "usage": {
            "input_tokens": record.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": record.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record.input_tokens + record.output_tokens,
        },
        "model": record.model,
        "metadata": record.metadata,
    }


def list_object(page: Page, render: Any) -> dict[str, Any]:
    data = [render(item) for item in page.items]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": page.has_more,
    }
