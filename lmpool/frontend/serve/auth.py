"""The optional API key: with one set, every ``/v1`` request, ``/server_info`` and
``/model_info`` (they name the model, as ``/v1/models`` does), ``/tokenize`` and ``/detokenize``
(the tokenizer's work is the server's CPU) must carry
``Authorization: Bearer <key>`` (as vLLM's ``--api-key``; a gateway sends its worker's key on
these probes too); ``/health`` and ``/metrics`` stay open for load balancers and scrapers."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from lmpool.frontend.serve.errors import error_body

KEYED_PATHS = ("/server_info", "/model_info", "/tokenize", "/detokenize")


def install_api_key(app, api_key: str | None) -> None:
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request, call_next):
        path = request.url.path
        if path.startswith("/v1") or path in KEYED_PATHS:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # constant time: no key guessing by timing
                return JSONResponse(error_body(401, "invalid or missing API key"), status_code=401)
        return await call_next(request)
