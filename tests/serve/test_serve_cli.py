"""``lmpool serve``'s command line refuses, by name, values it would otherwise act on wrongly."""

from __future__ import annotations

import pytest

from lmpool.frontend.serve.server import parser


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
