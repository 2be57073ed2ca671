"""``lmpool serve``'s command line refuses, by name, values it would otherwise act on wrongly."""

from __future__ import annotations

import socket

import pytest

from lmpool.frontend.serve.server import main, parser


@pytest.mark.parametrize("args, words", [
    (["--port", "99999"], "--port: must be a TCP port in [0, 65535]"),  # was served on 99999 % 65536
    (["--port", "-1"], "--port: must be a TCP port"),
    (["--port", "http"], "--port: must be a TCP port"),
    (["--shutdown-grace", "nan"], "--shutdown-grace: must be a finite number of seconds >= 0"),
    (["--shutdown-grace", "-1"], "--shutdown-grace: must be a finite number of seconds >= 0"),
    (["--max-request-bytes", "-1"], "--max-request-bytes: must be a whole number >= 0"),
    (["--max-request-bytes", "32M"], "--max-request-bytes: must be a whole number >= 0"),
    (["--timeout-request-headers", "0"], "--timeout-request-headers: must be a finite number of seconds > 0"),
    (["--timeout-request-body", "inf"], "--timeout-request-body: must be a finite number of seconds >= 0"),
    (["--timeout-keep-alive", "nan"], "--timeout-keep-alive: must be a finite number of seconds >= 0"),
    (["--limit-concurrency", "many"], "--limit-concurrency: must be a whole number >= 0"),
])
def test_bad_values_are_refused_by_name(args, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["model", *args])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_good_values_are_taken():
    args = parser().parse_args(["model", "--port", "0", "--shutdown-grace", "0"])
    assert args.port == 0 and args.shutdown_grace == 0


def test_a_taken_port_is_refused_before_the_pool_starts(tmp_path):
    """vLLM binds first; so does this check: no model is read, no process started."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot bind 127.0.0.1:{port}: Address already in use"):
            main([str(tmp_path / "no-model-here"), "--port", str(port)])
