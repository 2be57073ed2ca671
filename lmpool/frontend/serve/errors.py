"""OpenAI-style error bodies, and the status each failure maps to.

Bad input is a 400, a body over the size limit a 413, one that is not JSON a 415, a pool with no
live rank (or one shut down) a 503, anything unexpected a 500: every failure becomes a JSON body
for its caller and the server serves on.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lmpool.frontend.client import PoolError
from lmpool.frontend.serve.body_parser import validation_message


class ServeError(Exception):
    """A failure with the HTTP status it deserves."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> dict:
    # vLLM's shape: OpenAI's error object with the status as the code and its phrase as the type.
    kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def status_of(exc: BaseException) -> int:
    if isinstance(exc, ServeError):
        return exc.status
    if isinstance(exc, ValueError):
        return 400
    if isinstance(exc, PoolError):
        return 503
    return 500


def message_of(exc: BaseException) -> str:
    if status_of(exc) == 500 and not isinstance(exc, ServeError):
        return f"internal error: {type(exc).__name__}: {exc}"
    return str(exc)


def error_response(exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    return JSONResponse(error_body(status, message_of(exc)), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    return validation_message(exc.errors(), skip=("body",))


def install_handlers(app) -> None:
    """Route every failure, a malformed body included, into an OpenAI-style error body."""

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, _validation_message(exc)), status_code=400)

    async def any_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405...
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ServeError, any_error)
    app.add_exception_handler(ValueError, any_error)
    app.add_exception_handler(PoolError, any_error)
    app.add_exception_handler(Exception, any_error)
