"""``--api-key``: every /v1 route wants ``Authorization: Bearer KEY``; /health and /metrics stay
open. Checked on a bare app with the same middleware, no pool needed."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from lmpool.frontend.serve.auth import install_api_key
from lmpool.frontend.serve.errors import install_handlers


def app_with_key(key: str | None) -> FastAPI:
    app = FastAPI()
    install_handlers(app)
    install_api_key(app, key)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": []}

    @app.get("/health")
    async def health():
        return {}

    return app


async def get(app: FastAPI, path: str, **headers) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.get(path, headers=headers)


async def test_a_key_guards_v1_only():
    app = app_with_key("s3cret")
    missing = await get(app, "/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == 401
    assert (await get(app, "/v1/models", authorization="Bearer wrong")).status_code == 401
    assert (await get(app, "/v1/models", authorization="Bearer s3cret")).status_code == 200
    assert (await get(app, "/health")).status_code == 200


async def test_no_key_no_check():
    assert (await get(app_with_key(None), "/v1/models")).status_code == 200
