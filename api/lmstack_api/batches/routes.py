"""`/v1/files` and `/v1/batches`, in OpenAI's shapes.

Every route authenticates as a generation request does (`ServerState.caller`) and sees only the
caller's tenant: another tenant's file or batch is a 404, exactly as one that does not exist (its
existence is not confirmed either). Without API keys the tenant is the `X-Tenant` header (or
none), so isolation there is only as strong as the clients' honesty, like everything else on a
server without keys. With `server.batch_dir` unset every route is a 404 saying so.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.exceptions import HTTPException

from lmstack_api import params as P
from lmstack_api.batches.lines import ENDPOINTS, check_upload
from lmstack_api.batches.runner import BatchRunner, key_hash
from lmstack_api.batches.store import TIMESTAMPS, BatchStore
from lmstack_api.errors import APIError, clip, invalid
from lmstack_api.render import to_json
from lmstack_api.state import ServerState

JSON = "application/json"
# Multipart framing and the `purpose` field around the file itself.
_FORM_SLACK = 64 * 1024
WINDOWS = {"24h": 24 * 3600}


class BatchService:
    """The store and its runner, for one server."""

    def __init__(self, state: ServerState, root: str) -> None:
        self.state = state
        self.store = BatchStore(root)
        self.runner = BatchRunner(self.store, state)

    def start(self, app: Any) -> None:
        self.runner.start(app)

    async def stop(self) -> None:
        await self.runner.stop()
        self.store.close()


def open_batches(state: ServerState) -> BatchService | None:
    """The Batch API of this server: None when `server.batch_dir` is unset."""
    root = state.config.batch_dir
    return BatchService(state, root) if root else None


class CreateBatch(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


# --- helpers ---------------------------------------------------------------------------------


def _service(request: Request) -> tuple[BatchService, str, str | None]:
    """(service, the caller's tenant ("" for none), the caller's key); 401 / 404 as due."""
    state: ServerState = request.app.state["server"]
    key, tenant = state.caller(request.headers)
    service = request.app.state.get("batches")
    if service is None:
        raise APIError(
            404,
            "the Batch API is off on this server: set server.batch_dir to enable it",
            code="batch_api_disabled",
        )
    return service, tenant or "", key


def _json(payload: Any, status: int = 200) -> Response:
    return Response(content=to_json(payload), status_code=status, media_type=JSON)


def _not_found(kind: str, ident: str) -> APIError:
    return APIError(404, f"no {kind} with id {clip(ident)!r}", param=f"{kind}_id", code="not_found")


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid(f"limit must be an integer from 1 to {most}", param="limit")
    return int(raw)


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None,
    }


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    out = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }
    for name in TIMESTAMPS:
        out[name] = row[name]
    return out


def _page(objects: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": objects,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": more,
    }


# --- files -----------------------------------------------------------------------------------


def batch_routes(state: ServerState) -> list[Any]:
    """The handlers; the upload's body limit is `server.batch_max_upload_bytes`."""
    upload_limit = state.config.batch_max_upload_bytes

    @post("/v1/files", status_code=200, request_max_body_size=upload_limit + _FORM_SLACK)
    async def create_file(request: Request) -> Response:
        service, tenant, _ = _service(request)
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "multipart/form-data":
            raise invalid("upload the file as multipart/form-data with fields `file` and `purpose`")
        try:
            form = await request.form()
        except HTTPException as exc:
            if exc.status_code == 413:
                raise _too_large(upload_limit) from None
            raise invalid(f"the upload is not valid multipart/form-data: {exc.detail}") from None
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise invalid(f"purpose must be 'batch', got {clip(str(purpose))!r}", param="purpose")
        if not isinstance(upload, UploadFile):
            raise invalid("the form has no `file` field holding a file", param="file")
        data = await upload.read()
        await upload.close()
        if len(data) > upload_limit:
            raise _too_large(upload_limit)
        try:
            await asyncio.to_thread(check_upload, data)
        except ValueError as exc:
            raise invalid(str(exc), param="file", code="invalid_file") from None
        name = (upload.filename or "upload.jsonl")[:255]
        row = await service.store.run(service.store.add_file, tenant, "batch", name, data)
        return _json(file_object(row))

    return [
        create_file,
        list_files,
        retrieve_file,
        delete_file,
        file_content,
        create_batch,
        list_batches,
        retrieve_batch,
        cancel_batch,
    ]


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the file is larger than this server's limit of {limit} bytes (server.batch_max_upload_bytes)",
        code="request_too_large",
        close=True,
    )


@get("/v1/files")
async def list_files(request: Request) -> Response:
    service, tenant, _ = _service(request)
    rows, more = await service.store.run(
        service.store.list_files,
        tenant,
        request.query_params.get("purpose"),
        _limit(request, 10_000, 10_000),
        request.query_params.get("after"),
    )
    return _json(_page([file_object(r) for r in rows], more))


async def _own_file(request: Request) -> tuple[BatchService, str, dict[str, Any]]:
    service, tenant, _ = _service(request)
    file_id = str(request.path_params["file_id"])
    row = await service.store.run(service.store.get_file, tenant, file_id)
    if row is None:
        raise _not_found("file", file_id)
    return service, tenant, row


@get("/v1/files/{file_id:str}")
async def retrieve_file(request: Request) -> Response:
    _, _, row = await _own_file(request)
    return _json(file_object(row))


@get("/v1/files/{file_id:str}/content")
async def file_content(request: Request) -> Response:
    service, _, row = await _own_file(request)
    data = await service.store.run(service.store.file_path(row["id"]).read_bytes)
    return Response(content=data, status_code=200, media_type="application/jsonl")


@delete("/v1/files/{file_id:str}", status_code=200)
async def delete_file(request: Request) -> Response:
    service, tenant, row = await _own_file(request)
    using = await service.store.run(service.store.batch_using, row["id"])
    if using is not None:
        raise invalid(
            f"file {row['id']!r} is the input of batch {using!r}, which has not finished", param="file_id"
        )
    await service.store.run(service.store.delete_file, tenant, row["id"])
    return _json({"id": row["id"], "object": "file", "deleted": True})


# --- batches ---------------------------------------------------------------------------------


@post("/v1/batches", status_code=200)
async def create_batch(request: Request) -> Response:
    service, tenant, key = _service(request)
    req = P.decode_body(await request.body(), CreateBatch)
    if req.endpoint not in ENDPOINTS:
        raise invalid(
            f"endpoint must be one of {', '.join(ENDPOINTS)}, got {clip(req.endpoint)!r}", param="endpoint"
        )
    if req.completion_window not in WINDOWS:
        raise invalid(
            f"completion_window must be {' or '.join(WINDOWS)}, got {clip(req.completion_window)!r}",
            param="completion_window",
        )
    meta = req.metadata
    if meta is not None and (len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items())):
        raise invalid(
            "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters", param="metadata"
        )
    row = await service.store.run(service.store.get_file, tenant, req.input_file_id)
    if row is None:
        raise _not_found("file", req.input_file_id)
    if row["purpose"] != "batch":
        raise invalid(
            f"file {row['id']!r} has purpose {row['purpose']!r}, not 'batch'", param="input_file_id"
        )
    batch = await service.store.run(
        service.store.create_batch,
        tenant,
        key_hash(key),
        req.endpoint,
        row["id"],
        WINDOWS[req.completion_window],
        req.completion_window,
        meta,
    )
    service.runner.wake()
    return _json(batch_object(batch))


async def _own_batch(request: Request) -> tuple[BatchService, str, dict[str, Any]]:
    service, tenant, _ = _service(request)
    batch_id = str(request.path_params["batch_id"])
    row = await service.store.run(service.store.get_batch, tenant, batch_id)
    if row is None:
        raise _not_found("batch", batch_id)
    return service, tenant, row


@get("/v1/batches")
async def list_batches(request: Request) -> Response:
    service, tenant, _ = _service(request)
    rows, more = await service.store.run(
        service.store.list_batches, tenant, _limit(request, 20, 100), request.query_params.get("after")
    )
    return _json(_page([batch_object(r) for r in rows], more))


@get("/v1/batches/{batch_id:str}")
async def retrieve_batch(request: Request) -> Response:
    _, _, row = await _own_batch(request)
    return _json(batch_object(row))


@post("/v1/batches/{batch_id:str}/cancel", status_code=200)
async def cancel_batch(request: Request) -> Response:
    service, tenant, row = await _own_batch(request)
    if row["status"] in ("validating", "in_progress"):
        await service.store.run(
            service.store.set_status, row["id"], "cancelling", when=("validating", "in_progress")
        )
        service.runner.wake(row["id"])
    elif row["status"] not in ("cancelling", "cancelled"):
        raise APIError(
            409,
            f"batch {row['id']!r} is {row['status']} and can no longer be cancelled",
            code="batch_not_cancellable",
        )
    row = await service.store.run(service.store.get_batch, tenant, row["id"])
    return _json(batch_object(row))
