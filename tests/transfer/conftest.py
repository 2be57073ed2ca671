"""Fixtures of the transport tests: a pool rendezvous, and peer processes reaped after each test."""

from __future__ import annotations

import pytest

from lmpool.transfer import Rendezvous
from transfer_testkit import Peer, reap


@pytest.fixture
def rendezvous():
    rz = Rendezvous.create()
    yield rz.address
    rz.close()


@pytest.fixture
def peers():
    started: list[Peer] = []
    yield started
    assert reap(started) == [], "a peer process was still running at the end of the test"
