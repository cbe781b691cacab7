"""OpenAI-shaped errors, ``{"error": {"message", "type", "param", "code"}}``, by status."""

from __future__ import annotations

from starlette.responses import JSONResponse


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
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=headers)


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
        type="service_unavailable",
        code="no_replica",
        retry_after_s=retry_after_s,
    )


def upstream_timeout(setting: str, seconds: float) -> APIError:
    return APIError(
        504,
        f"The engine did not answer within {seconds:g}s (raise {setting} to wait longer)",
        type="timeout",
        code="upstream_timeout",
    )


def upstream_unreachable(detail: str) -> APIError:
    return APIError(
        502,
        f"The engine could not be reached: {detail}",
        type="upstream_error",
        code="upstream_unreachable",
    )
