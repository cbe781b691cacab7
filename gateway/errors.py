"""OpenAI-shaped errors, ``{"error": {"message", "type", "param", "code"}}``, by status.

Every error a client sees has this shape and OpenAI's vocabulary: ``type`` one of `TYPES`
(unknown ones, and the engine's own such as vLLM's "BadRequestError" or
"InternalServerError", are replaced by the type of the status, `type_for`), ``code`` a
string or null, ``message`` never empty. An engine's error, whatever its shape (vLLM's
``{"error": {..., "code": 500}}``, FastAPI's ``{"detail": ...}``, plain text), is rewritten
by `openai_error_body`; an error event in a stream by `openai_error_event`.
"""

from __future__ import annotations

import msgspec
from starlette.responses import JSONResponse

TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "server_error",
    }
)


def type_for(status: int, given: object = None) -> str:
    """The error type for a status: `given` if it is in OpenAI's vocabulary, else by status."""
    if isinstance(given, str) and given in TYPES:
        return given
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        body = {
            "error": {
                "message": self.message,
                "type": type_for(self.status, self.type),
                "param": self.param,
                "code": self.code,
            }
        }
        return _ErrorResponse(body, status_code=self.status, headers=headers)


class _ErrorResponse(JSONResponse):
    """A message may quote client input: a lone surrogate there is escaped, not a crash."""

    def render(self, content: object) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return msgspec.json.encode(_escape_surrogates(content))


def _escape_surrogates(value: object) -> object:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {k: _escape_surrogates(v) for k, v in value.items()}
    return value


def server_error(request_id: str) -> APIError:
    """The last line of defence: an exception the gateway did not expect (logged by the
    caller as one line with the request id)."""
    return APIError(
        500,
        f"The gateway failed on this request (request id {request_id}); it has been "
        "logged. Retrying may help.",
        type="server_error",
        code="internal_error",
    )


class _ErrorBody(msgspec.Struct):
    error: object = None
    message: object = None  # vLLM's flat shape: {"object": "error", "message", ...}
    detail: object = None  # FastAPI's: {"detail": "There was an error parsing the body"}
    type: object = None
    param: object = None
    code: object = None


_error_decoder = msgspec.json.Decoder(_ErrorBody)


def openai_error(status: int, payload: bytes, request_id: str = "") -> dict[str, object]:
    """An engine's error answer (status, body) as the fields of OpenAI's ``error``."""
    try:
        body: _ErrorBody | None = _error_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        body = None
    source = body
    if body is not None and isinstance(body.error, dict):
        inner = body.error
        source = _ErrorBody(
            message=inner.get("message"),
            type=inner.get("type"),
            param=inner.get("param"),
            code=inner.get("code"),
        )
    elif body is not None and body.message is None and body.detail is not None:
        source = _ErrorBody(message=body.detail)
    message = source.message if source is not None else None
    if message is not None and not isinstance(message, str):
        message = msgspec.json.encode(message).decode()
    if source is None and payload.strip():
        text = payload.decode("utf-8", "replace").strip()[:500]
        message = text if status >= 500 else f"The engine answered {status}: {text}"
    code = source.code if source is not None else None
    if isinstance(code, int) and 100 <= code <= 599 and status == 200:
        status = code  # an error event in a 200 stream carries the engine's status
    if not message or not message.strip():
        message = (
            f"The engine failed on this request (HTTP {status}) and gave no detail"
            if status >= 500
            else f"The engine refused this request (HTTP {status}) and gave no detail"
        )
    elif status >= 500:
        message = f"The engine failed on this request (HTTP {status}): {message}"
    if status >= 500 and request_id:
        message += f" (request id {request_id})"
    param = source.param if source is not None else None
    return {
        "message": message,
        "type": type_for(status, source.type if source is not None else None),
        "param": param if isinstance(param, str) else None,
        "code": code if isinstance(code, str) else ("engine_error" if status >= 500 else None),
    }


def openai_error_body(status: int, payload: bytes, request_id: str = "") -> bytes:
    """An engine's error, whatever shape (or none) it came in, as OpenAI's {"error": ...}."""
    return msgspec.json.encode({"error": openai_error(status, payload, request_id)})


def error_status(payload: bytes) -> int:
    """The status an engine's error event in a stream stands for (its numeric code, else
    500)."""
    try:
        body = _error_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return 500
    code = body.error.get("code") if isinstance(body.error, dict) else body.code
    return code if isinstance(code, int) and 400 <= code <= 599 else 500


def openai_error_event(payload: bytes, request_id: str = "") -> bytes:
    """An engine's ``data: {"error": ...}`` stream event (the JSON after ``data: ``) in
    OpenAI's shape, as a whole event."""
    error = openai_error(error_status(payload), payload, request_id)
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"


def bad_request(message: str, *, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{model}' does not exist", param="model", code="model_not_found"
    )


def model_not_allowed(tenant: str, model: str) -> APIError:
    return APIError(
        403,
        f"Tenant '{tenant}' may not use the model '{model}' (see its allowed_models)",
        type="permission_error",
        param="model",
        code="model_not_allowed",
    )


def no_replica(model: str, retry_after_s: int = 5) -> APIError:
    return APIError(
        503,
        f"No replica of model '{model}' is serving right now; retry shortly",
        type="server_error",
        code="no_replica",
        retry_after_s=retry_after_s,
    )


def model_starting(model: str, waited_s: float, retry_after_s: int) -> APIError:
    """A request for a model whose pool was scaled to zero and did not wake within the
    gateway's hold budget (pools[].autoscale.wake_budget_s)."""
    return APIError(
        503,
        f"The model '{model}' was scaled to zero and is starting; no replica came within "
        f"{waited_s:g}s. Retry after {retry_after_s}s",
        type="server_error",
        code="model_starting",
        retry_after_s=retry_after_s,
    )


def client_gone() -> APIError:
    """The client disconnected before its request was sent anywhere (held for a pool at
    zero): 499 in the metrics and the audit log, as for a stream it cut; nobody reads it."""
    return APIError(499, "The client closed the connection", code="client_closed_request")


def upstream_timeout(setting: str, seconds: float) -> APIError:
    return APIError(
        504,
        f"The engine did not answer within {seconds:g}s (raise {setting} to wait longer)",
        type="server_error",
        code="upstream_timeout",
    )


def upstream_unreachable(detail: str) -> APIError:
    return APIError(
        502,
        f"The engine could not be reached: {detail}",
        type="server_error",
        code="upstream_unreachable",
    )
