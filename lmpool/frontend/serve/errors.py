"""OpenAI-style error bodies, and the status each failure maps to.

Bad input is a 400, a body over the size limit a 413, one that is not JSON a 415, a pool with no
live rank (or one shut down) a 503, a client gone before its answer a 499, anything unexpected
a 500: every failure becomes a JSON body for its caller and the server serves on, its connection
kept alive (an unexpected error answered before its response began is logged with its traceback,
not re-raised to uvicorn, which closes the connection under a client that may already be sending
its next request on it).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from lmpool.frontend.client import PoolError
from lmpool.frontend.serve.disconnect import ClientGone
from lmpool.frontend.serve.validation_errors import described

log = logging.getLogger("uvicorn.error")

class ServeError(Exception):
    """A failure with the HTTP status it deserves, and the request field at fault (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    # vLLM's shape: OpenAI's error object with the status as the code and its phrase as the type;
    # param names the field at fault, as OpenAI's does.
    kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


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
    return JSONResponse(error_body(status, message_of(exc), getattr(exc, "param", None)), status_code=status)


def install_handlers(app) -> None:
    """Route every failure, a malformed body included, into an OpenAI-style error body."""

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, *described(exc.errors(), skip=("body",))), status_code=400)

    async def any_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405...
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    async def gone(request: Request, exc: ClientGone) -> Response:  # nobody reads it: nginx's "client closed"
        return Response(status_code=499)

    app.add_exception_handler(ClientGone, gone)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ServeError, any_error)
    app.add_exception_handler(ValueError, any_error)
    app.add_exception_handler(PoolError, any_error)
    app.add_middleware(AnswerUnexpected)


class AnswerUnexpected:
    """Answers an unexpected error with its 500 body and keeps the connection.

    Starlette hands a handler for ``Exception`` to its outermost middleware, which re-raises once
    the response is sent, and uvicorn then closes the connection (a keep-alive client's next
    request met a reset). This sits inside that middleware and does not re-raise. An error after
    the response began is left to propagate: a half-sent body cannot be completed, so that
    connection must close."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            log.exception("unexpected error serving %s %s", scope.get("method"), scope.get("path"))
            await error_response(exc)(scope, receive, send)
