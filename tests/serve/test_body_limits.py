"""``lmpool serve``'s request-body limit and its body-parsing process, on a real server: a body
over ``--max-request-bytes`` is a 413 whether its size is declared or chunked, it starts no
request, the same connection then serves one, and the server holds none of it even when the
client sends on; a large body waits on the parsing process without holding up any other request,
and gets the answers a small one gets."""

from __future__ import annotations

import json
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_process import PROMPT, busy, metric, pool_children, read_response, request_head, small_request, \
    start_server, wait_for

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = start_server(tiny_model, tmp_path_factory.mktemp("limits"), "--world-size", "1",
                          "--max-request-bytes", str(LIMIT))
    yield server
    server.stop()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def peak_memory(pid: int) -> int:
    """The process's resident-memory high-water mark, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def assert_413(status: int, body: bytes) -> None:
    error = json.loads(body)["error"]
    assert status == 413 == error["code"] and f"{LIMIT}-byte limit" in error["message"]


def prompt_tokens(server) -> int:
    """The prompt tokens of ``small_request``'s prompt (a request of its own)."""
    body = {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True}
    return len(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["prompt_token_ids"])


def test_bodies_over_the_limit_are_413_and_the_connection_serves_on(server):
    per_request = prompt_tokens(server)
    wait_for(lambda: metric(server, "lmpool:prompt_tokens_total") >= per_request, "the board counting a request")
    admitted = metric(server, "lmpool:prompt_tokens_total")
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        # Declared too long: refused before any of it is read; the client sends it anyway, and the
        # server drops it as it comes.
        sock.sendall(request_head(LIMIT + LIMIT // 2))
        status, _, body = read_response(sock)
        assert_413(status, body)
        assert f"({LIMIT + LIMIT // 2} bytes)" in json.loads(body)["error"]["message"]
        sock.sendall(b"x" * (LIMIT + LIMIT // 2))
        sock.sendall(small_request())
        status, _, body = read_response(sock)
        assert status == 200, body
        # Chunked: refused once past the limit.
        sock.sendall(request_head())
        for _ in range(24):
            sock.sendall(chunk(b"y" * (LIMIT // 16)))
        sock.sendall(b"0\r\n\r\n")
        status, _, body = read_response(sock)
        assert_413(status, body)
        sock.sendall(small_request())
        status, _, body = read_response(sock)
        assert status == 200, body
    # Only the two small requests reached the pool.
    wait_for(lambda: metric(server, "lmpool:prompt_tokens_total") >= admitted + 2 * per_request,
             "the board counting the small requests")
    assert metric(server, "lmpool:prompt_tokens_total") == admitted + 2 * per_request
    wait_for(lambda: busy(server) == 0, "an idle pool")


def send_until_closed(sock: socket.socket, data: bytes, times: int) -> None:
    with pytest.raises(OSError):  # a reset, or the pipe broken, once the server has closed
        for _ in range(times):
            sock.sendall(data)
        assert sock.recv(1) == b"", "the connection should have been closed"
        raise ConnectionResetError("closed")


def test_a_body_sent_on_past_twice_the_limit_is_dropped_unbuffered_and_closes_the_connection(server):
    """What comes of an answered request's body is dropped; a client that sends more than twice
    the limit of it loses the connection, and the server has held none of it."""
    peak = peak_memory(server.proc.pid)
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(request_head(64 * LIMIT))
        status, _, body = read_response(sock)
        assert_413(status, body)
        send_until_closed(sock, b"x" * LIMIT, 64)
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(request_head())
        send_until_closed(sock, chunk(b"z" * LIMIT), 64)
    assert peak_memory(server.proc.pid) - peak < 16 * LIMIT  # 128 MiB was sent at it
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                      timeout=60).status_code == 200


def parse_worker(server) -> int:
    [pid] = pool_children(server.proc.pid, b"lmpool.frontend.serve.body_parser")
    return pid


def bytes_read(pid: int) -> int:
    """Bytes ``pid`` has read, from sockets and pipes as from files (``rchar``)."""
    line = next(line for line in Path(f"/proc/{pid}/io").read_text().splitlines() if line.startswith("rchar:"))
    return int(line.split()[1])


def test_a_large_body_waits_on_the_parsing_process_while_other_requests_are_served(server):
    """The parsing process is stopped (SIGSTOP) while it holds a 400 KB body: the server answers a
    small request and streams another meanwhile, and the large one is answered once it runs on."""
    big = {"prompt": PROMPT, "max_tokens": 2, "user": "u" * 400_000}  # unknown fields are ignored
    worker = parse_worker(server)
    before = bytes_read(server.proc.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as thread:
            pending = thread.submit(httpx.post, f"{server.url}/v1/completions", json=big, timeout=120)
            wait_for(lambda: bytes_read(server.proc.pid) - before > 400_000, "the server reading the large body")
            small = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
            assert small.status_code == 200, small.text
            body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                lines = [line for line in response.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 2
            assert not pending.done(), "the large body was answered while its parser was stopped"
            os.kill(worker, signal.SIGCONT)
            response = pending.result()
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
    finally:
        os.kill(worker, signal.SIGCONT)


def test_large_bodies_get_the_same_answers_as_small_ones(server):
    """Through the parsing process (over 64 KiB), a bad body is the 400 it is inline."""
    pad = {"user": "u" * 80_000}
    for body, words in (({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"), ({"prompt": ["a", ""]}, "prompt 1 is empty"),
                        ({"prompt": PROMPT, "temperature": True}, "temperature"),
                        ({"messages": [{"role": "user"}]}, "Missing required parameter: 'prompt'.")):
        for extra in ({}, pad):
            response = httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, timeout=60)
            error = response.json()["error"]
            assert response.status_code == 400 == error["code"] and words in error["message"], (extra.keys(), error)
    unclosed = b'{"prompt": "x", "user": "' + b"u" * 80_000 + b'"'
    bad = httpx.post(f"{server.url}/v1/completions", content=unclosed, headers={"content-type": "application/json"},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["message"] == (
        f"The request body is not valid JSON (EOF while parsing an object at line 1 column {len(unclosed)}).")
