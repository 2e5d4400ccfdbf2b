"""Every error a client gets back is an OpenAI-shaped JSON body, whoever raised it.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

nanoserve's own refusals are `ApiError`s (protocol.py) and a body that does not
validate is a `RequestValidationError`; the framework answers a few things
itself, in its own shape: an unknown route (`{"detail": "Not Found"}`), a wrong
method (405), a body it cannot parse (JSON nested 100,000 deep: `{"detail":
"There was an error parsing the body"}`), and an exception nobody caught (a
plain-text 500). `install_error_handlers(app)` registers one handler for each,
here in one place, so that OpenAI clients (which read `error.message`) always
get a sentence they can show. The body limits (limits.py) answer 408 and 413
with the same bodies.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanoserve.serve.protocol import ApiError, validation_error

log = logging.getLogger("nanoserve.serve")


def error_response(error: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def http_error(request: Request, exc: HTTPException) -> ApiError:
    """The framework's own HTTPException as an ApiError with a sentence."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return ApiError(404, f"there is no route {where} (the routes are listed at /docs)", code="not_found")
    if exc.status_code == 405:
        return ApiError(405, f"{where} is not allowed (allowed: {exc.headers.get('Allow', '?') if exc.headers else '?'})",
                        code="method_not_allowed")
    if exc.status_code == 400 and exc.__cause__ is not None:   # FastAPI could not parse the body
        cause = exc.__cause__
        why = "nested too deeply" if isinstance(cause, RecursionError) else f"{type(cause).__name__}: {cause}"
        return ApiError(400, f"the request body could not be parsed as JSON ({why})", code="invalid_json")
    return ApiError(exc.status_code, str(exc.detail))


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped bodies for ApiError, validation errors, the framework's HTTP errors and any other exception."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, exc: HTTPException) -> JSONResponse:
        headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() in ("allow", "www-authenticate")}
        return error_response(http_error(request, exc), headers or None)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        # (Starlette logs the exception after this answer: a bug here must still be visible)
        return error_response(ApiError(500, f"the server failed on this request: {type(exc).__name__}: {exc}",
                                       code="internal_error"))
