"""HTTP handlers of /v1/files and /v1/batches, in the gateway's handler style.

A tenant sees, reads, deletes and cancels only its own files and batches (another
tenant's look like missing ones: 404); an admin key sees all of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from hpcserve.contracts.batch_backlog import FileSummary
from hpcserve.contracts.private_files import private_opener
from hpcserve.gateway import errors
from hpcserve.gateway.batch.objects import batch_object, file_object, list_object
from hpcserve.gateway.batch.service import BatchService
from hpcserve.gateway.batch.store import (
    BatchRecord,
    BatchStore,
    Conflict,
    FileRecord,
    NotFound,
    new_id,
)
from hpcserve.gateway.batch.validate import (
    ENDPOINTS,
    InvalidBatchFile,
    validate_batch_file,
)

if TYPE_CHECKING:
    from hpcserve.gateway.app import Gateway

T = TypeVar("T")
Handler = Callable[["Gateway", Request], Awaitable[Response]]
Wrap = Callable[["Gateway", str, Handler], Callable[[Request], Awaitable[Response]]]

COMPLETION_WINDOWS = ("24h",)
MULTIPART_OVERHEAD = 64 * 1024
CHUNK = 1 << 20


class _TooLarge(Exception):
    pass


def _service(gateway: Gateway) -> BatchService:
    service = gateway.batch
    if service is None:
        raise errors.APIError(404, "The Batch API is not enabled on this gateway")
    return service


def _scope(gateway: Gateway, request: Request) -> tuple[str, str | None]:
    """(the caller's tenant name, the tenant whose objects it may see; None: all)."""
    tenant = gateway.keys.tenant_for(request.headers.get("authorization"))
    return tenant.name, None if tenant.admin else tenant.name


def _not_found(err: NotFound) -> errors.APIError:
    return errors.APIError(404, str(err), code="not_found")


def _conflict(err: Conflict) -> errors.APIError:
    return errors.APIError(409, str(err), code="conflict")


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise errors.bad_request(
            f"'{name}' must be an integer from {low} to {high}, got {raw!r}", param=name
        )
    return int(raw)


# -- files ---------------------------------------------------------------------------------


def _copy_and_validate(
    source: IO[bytes], temp_path: Path, *, max_bytes: int, max_lines: int
) -> FileSummary:
    """Copy an upload to temp_path, validating it on the way (InvalidBatchFile, _TooLarge)."""
    size = 0

    def chunks(out: IO[bytes]) -> Iterator[bytes]:
        nonlocal size
        while chunk := source.read(CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise _TooLarge
            out.write(chunk)
            yield chunk

    with open(temp_path, "wb", opener=private_opener) as out:
        return validate_batch_file(chunks(out), max_lines=max_lines)


async def upload_file(gateway: Gateway, request: Request) -> Response:
    service = _service(gateway)
    tenant, _ = _scope(gateway, request)
    limit = service.config.max_file_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
        raise errors.APIError(
            413,
            f"Upload of {declared} bytes exceeds batch.max_file_bytes ({limit} bytes)",
            code="file_too_large",
        )
    try:
        form = await request.form(max_files=1, max_fields=16)
    except MultiPartException as err:
        raise errors.bad_request(f"Malformed multipart upload: {err.message}") from None
    try:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose != "batch":
            raise errors.bad_request(
                f"'purpose' must be 'batch' (the only purpose served here), got {purpose!r}",
                param="purpose",
            )
        if not isinstance(upload, UploadFile):
            raise errors.bad_request("'file' is required: the JSONL file to upload", param="file")
        store = service.store
        temp = store.temp_path()
        try:
            summary = await asyncio.to_thread(
                _copy_and_validate,
                upload.file,
                temp,
                max_bytes=limit,
                max_lines=service.config.max_lines,
            )
            record = await asyncio.to_thread(
                store.add_file,
                temp,
                tenant=tenant,
                filename=upload.filename or "upload.jsonl",
                purpose="batch",
                summary=summary,
            )
        except _TooLarge:
            raise errors.APIError(
                413,
                f"File exceeds batch.max_file_bytes ({limit} bytes)",
                param="file",
                code="file_too_large",
            ) from None
        except InvalidBatchFile as err:
            raise errors.bad_request(f"Invalid batch file: {err}", param="file") from None
        finally:
            temp.unlink(missing_ok=True)
    finally:
        await form.close()
    return JSONResponse(file_object(record))


async def list_files(gateway: Gateway, request: Request) -> Response:
    service = _service(gateway)
    _, scope = _scope(gateway, request)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise errors.bad_request(f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
    page = await asyncio.to_thread(
        service.store.list_files,
        scope,
        purpose=request.query_params.get("purpose"),
        after=request.query_params.get("after"),
        limit=_int_param(request, "limit", 10_000, 1, 10_000),
        newest_first=order == "desc",
    )
    return JSONResponse(list_object(page, file_object))


async def _owned(
    gateway: Gateway,
    request: Request,
    param: str,
    action: Callable[[BatchStore], Callable[[str, str | None], T]],
) -> tuple[BatchService, T]:
    """action(store)(the path's id, the caller's scope) in a thread, its NotFound as a 404
    and its Conflict as a 409: the shape of every handler on one file or batch."""
    service = _service(gateway)
    _, scope = _scope(gateway, request)
    try:
        return service, await asyncio.to_thread(
            action(service.store), request.path_params[param], scope
        )
    except NotFound as err:
        raise _not_found(err) from None
    except Conflict as err:
        raise _conflict(err) from None


async def _file(gateway: Gateway, request: Request) -> tuple[BatchService, FileRecord]:
    return await _owned(gateway, request, "file_id", lambda store: store.get_file)


async def retrieve_file(gateway: Gateway, request: Request) -> Response:
    _, record = await _file(gateway, request)
    return JSONResponse(file_object(record))


async def file_content(gateway: Gateway, request: Request) -> Response:
    service, record = await _file(gateway, request)
    return FileResponse(
        service.store.path_of(record.id),
        media_type="application/jsonl",
        filename=record.filename,
    )


async def delete_file(gateway: Gateway, request: Request) -> Response:
    await _owned(gateway, request, "file_id", lambda store: store.delete_file)
    return JSONResponse({"id": request.path_params["file_id"], "object": "file", "deleted": True})


# -- batches -------------------------------------------------------------------------------


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16:
        raise errors.bad_request(
            "'metadata' must be an object of at most 16 string pairs", param="metadata"
        )
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > 64 or len(item) > 512:
            raise errors.bad_request(
                f"'metadata.{key[:64]}': keys are strings of at most 64 characters and "
                "values strings of at most 512",
                param="metadata",
            )
    return dict(value)


async def create_batch(gateway: Gateway, request: Request) -> Response:
    service = _service(gateway)
    tenant, scope = _scope(gateway, request)
    _, payload = await gateway.read_json(request)
    file_id = payload.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise errors.bad_request("'input_file_id' is required", param="input_file_id")
    endpoint = payload.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise errors.bad_request(
            f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
            param="endpoint",
        )
    window = payload.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise errors.bad_request(
            f"'completion_window' must be '24h', got {window!r}", param="completion_window"
        )
    metadata = _metadata(payload.get("metadata"))
    try:
        file = await asyncio.to_thread(service.store.get_file, file_id, scope)
    except NotFound as err:
        raise _not_found(err) from None
    if file.purpose != "batch" or file.summary is None:
        raise errors.bad_request(
            f"File {file_id} has purpose '{file.purpose}'; a batch needs a 'batch' file",
            param="input_file_id",
        )
    now = int(time.time())
    record = BatchRecord(
        id=new_id("batch_"),
        tenant=tenant,
        endpoint=endpoint,
        input_file_id=file_id,
        completion_window=window,
        status="validating",
        created_at=now,
        expires_at=now + int(service.config.completion_window_s),
        total=file.summary.lines,
        metadata=metadata,
        model=file.summary.models[0] if len(file.summary.models) == 1 else None,
    )
    await asyncio.to_thread(service.store.create_batch, record)
    service.runner.notify()
    return JSONResponse(batch_object(record))


async def list_batches(gateway: Gateway, request: Request) -> Response:
    service = _service(gateway)
    _, scope = _scope(gateway, request)
    page = await asyncio.to_thread(
        service.store.list_batches,
        scope,
        after=request.query_params.get("after"),
        limit=_int_param(request, "limit", 20, 1, 100),
    )
    return JSONResponse(list_object(page, batch_object))


async def retrieve_batch(gateway: Gateway, request: Request) -> Response:
    _, record = await _owned(gateway, request, "batch_id", lambda store: store.get_batch)
    return JSONResponse(batch_object(record))


async def cancel_batch(gateway: Gateway, request: Request) -> Response:
    service, record = await _owned(gateway, request, "batch_id", lambda store: store.request_cancel)
    service.runner.cancel(record.id)
    return JSONResponse(batch_object(record))


def batch_routes(gateway: Gateway, wrap: Wrap) -> list[Route]:
    """The Batch API's routes, each wrapped like the gateway's own (errors, metrics)."""
    return [
        Route("/v1/files", wrap(gateway, "files", upload_file), methods=["POST"]),
        Route("/v1/files", wrap(gateway, "files", list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", wrap(gateway, "files", retrieve_file), methods=["GET"]),
        Route("/v1/files/{file_id}", wrap(gateway, "files", delete_file), methods=["DELETE"]),
        Route(
            "/v1/files/{file_id}/content",
            wrap(gateway, "files", file_content),
            methods=["GET"],
        ),
        Route("/v1/batches", wrap(gateway, "batches", create_batch), methods=["POST"]),
        Route("/v1/batches", wrap(gateway, "batches", list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", wrap(gateway, "batches", retrieve_batch), methods=["GET"]),
        Route(
            "/v1/batches/{batch_id}/cancel",
            wrap(gateway, "batches", cancel_batch),
            methods=["POST"],
        ),
    ]
