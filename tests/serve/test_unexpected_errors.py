"""An unexpected error is a 500 body on a connection that stays open: the client's next request
on it is served (uvicorn closed the connection under it when the error reached the server, and
a keep-alive client met a reset). The app carries the server's own handlers and one route that
fails as no handler foresaw."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import uvicorn
from fastapi import FastAPI
from serve_process import read_response

from lmpool.frontend.serve.errors import install_handlers


def failing_app() -> FastAPI:
    app = FastAPI()
    install_handlers(app)

    @app.get("/broken")
    async def broken():
        raise RuntimeError("a fault nobody foresaw")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    return app


@pytest.fixture(scope="module")
def port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections queue in the kernel until the server takes them: no wait on its start
    server = uvicorn.Server(uvicorn.Config(failing_app(), log_level="critical", http="httptools"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join()
    sock.close()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def test_an_unexpected_error_is_a_500_body_and_the_connection_serves_on(port):
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        for _ in range(3):
            sock.sendall(get("/broken"))
            status, headers, body = read_response(sock)
            error = json.loads(body)["error"]
            assert status == error["code"] == 500
            assert error["message"] == "internal error: RuntimeError: a fault nobody foresaw"
            assert headers.get("connection") != "close"
            sock.sendall(get("/fine"))
            status, _, body = read_response(sock)
            assert (status, json.loads(body)) == (200, {"ok": True})


def statuses(stream, n: int) -> list[int]:
    """The statuses of the next ``n`` responses on a buffered stream (responses may share a read)."""
    got = []
    for _ in range(n):
        head = [stream.readline()]
        while head[-1] != b"\r\n":
            assert head[-1], f"the connection closed after {got}"
            head.append(stream.readline())
        length = next(int(line.split(b":")[1]) for line in head if line.lower().startswith(b"content-length"))
        stream.read(length)
        got.append(int(head[0].split()[1]))
    return got


def test_requests_sent_together_behind_an_error_are_each_answered(port):
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock, sock.makefile("rb") as stream:
        sock.sendall(get("/broken") + get("/fine") + get("/broken") + get("/fine"))
        assert statuses(stream, 4) == [500, 200, 500, 200]
