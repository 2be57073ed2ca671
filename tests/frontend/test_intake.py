"""A request's intake (``client.intake_seconds``): from the start of its send to its rank to its
arrival at that rank's worker (read off the link), on the host's one monotonic clock."""

from __future__ import annotations

import pytest

from lmpool.frontend.client import intake_seconds


def test_intake_runs_from_the_send_to_the_worker_s_arrival():
    assert intake_seconds(100.0, 100.25) == pytest.approx(0.25)


def test_intake_is_unknown_without_a_send_or_an_arrival_and_never_negative():
    assert intake_seconds(0.0, 5.0) is None  # never sent (a request answered without a hand-over)
    assert intake_seconds(100.0, None) is None  # a worker that reports no arrival
    assert intake_seconds(100.0, 99.9999) == 0.0  # two processes' clock reads a hair apart
