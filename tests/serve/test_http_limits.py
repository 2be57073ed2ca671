"""Slow and oversized requests on a real ``lmpool serve``: a connection that does not deliver its
request head, or its body, within the deadlines gets a 408 and is closed, a head over
``--max-header-bytes`` a 431, while requests sent in time, on fresh and kept-alive connections,
are served; and the command line's limits reach uvicorn's configuration as given.

The tests wait for the server's own deadlines, blocked on the socket, and bound only how long a
failure takes (the socket timeout)."""

from __future__ import annotations

import json
import socket

import pytest
import uvicorn
from serve_process import read_response, request_head, small_request, start_server

from lmpool.frontend.serve.http_limits import LimitedHttpToolsProtocol
from lmpool.frontend.serve.server import parser, settings_from, uvicorn_config
from lmpool.frontend.serve.settings import HttpLimits

HEADERS_S, BODY_S, HEAD_BYTES = 2, 3, 8192  # seconds long enough that a loaded machine serves requests in time


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = start_server(tiny_model, tmp_path_factory.mktemp("slow"), "--world-size", "1",
                          "--timeout-request-headers", str(HEADERS_S), "--timeout-request-body", str(BODY_S),
                          "--max-header-bytes", str(HEAD_BYTES))
    yield server
    server.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=120)


def refused_then_closed(sock: socket.socket, status: int, words: str) -> None:
    got, headers, body = read_response(sock)
    error = json.loads(body)["error"]
    assert got == status == error["code"] and words in error["message"], error
    assert headers["connection"] == "close"
    assert sock.recv(1) == b"", "the connection should be closed"


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_request_head_not_sent_in_time_is_a_408(server, sent):
    with connect(server) as sock:
        sock.sendall(sent)
        refused_then_closed(sock, 408, f"did not send its request headers within {HEADERS_S} s")


def test_a_request_body_not_sent_in_time_is_a_408(server):
    with connect(server) as sock:
        sock.sendall(request_head(100) + b'{"prompt": ')
        refused_then_closed(sock, 408, f"did not send its request body within {BODY_S} s")


def test_a_kept_alive_connection_s_next_request_has_its_own_head_deadline(server):
    with connect(server) as sock:
        sock.sendall(small_request())
        assert read_response(sock)[0] == 200
        sock.sendall(b"POST /v1/comp")
        refused_then_closed(sock, 408, "request headers")


def test_a_request_head_over_the_limit_is_a_431(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"p" * (2 * HEAD_BYTES))
        refused_then_closed(sock, 431, f"larger than the {HEAD_BYTES}-byte limit")


def test_requests_sent_in_time_are_served(server):
    with connect(server) as sock:
        for _ in range(3):  # one connection, kept alive
            sock.sendall(small_request())
            assert read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"p" * (HEAD_BYTES // 2) + b"\r\n\r\n")
        assert read_response(sock)[0] == 200


def test_the_limits_reach_uvicorn():
    args = parser().parse_args(["m", "--max-request-bytes", "1000", "--max-header-bytes", "2000",
                                "--timeout-request-headers", "3", "--timeout-request-body", "4",
                                "--timeout-keep-alive", "7", "--limit-concurrency", "50", "--backlog", "60"])
    limits = settings_from(args).limits
    assert limits == HttpLimits(max_request_bytes=1000, max_header_bytes=2000, timeout_request_headers_s=3,
                                timeout_request_body_s=4, timeout_keep_alive_s=7, limit_concurrency=50, backlog=60)
    config = uvicorn_config(object(), args, limits)
    assert isinstance(config, uvicorn.Config)
    assert (config.timeout_keep_alive, config.limit_concurrency, config.backlog) == (7, 50, 60)
    assert config.h11_max_incomplete_event_size == 2000 and config.ws == "none" and config.loop == "uvloop"
    assert issubclass(config.http, LimitedHttpToolsProtocol) and config.http.limits is limits


def test_the_defaults_reach_uvicorn_and_zero_concurrency_is_no_limit():
    args = parser().parse_args(["m"])
    limits = settings_from(args).limits
    assert limits == HttpLimits()
    config = uvicorn_config(object(), args, limits)
    assert (config.timeout_keep_alive, config.limit_concurrency, config.backlog) == (5, 4096, 2048)
    assert config.http.limits.max_request_bytes == 32 * 1024 * 1024
    assert settings_from(parser().parse_args(["m", "--limit-concurrency", "0"])).limits.limit_concurrency is None
