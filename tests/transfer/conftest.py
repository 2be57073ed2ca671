"""Fixtures of the transport tests: a pool rendezvous, peer processes reaped after each test, and
a gloo pair in this process."""

from __future__ import annotations

import pytest

from lmpool.dataplane import GlooTransport
from lmpool.frontend.rendezvous import Rendezvous
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


@pytest.fixture
def pair(rendezvous):
    """Ranks 0 and 1 of a two-rank pool, connected under session 1 (each end is its own gloo
    group with its own sockets)."""
    a = GlooTransport(rendezvous, 0, 2, timeout_s=10)
    b = GlooTransport(rendezvous, 1, 2, timeout_s=10)
    for h in (a.connect(1, 1), b.connect(0, 1)):
        h.wait(10)
    yield a, b
    a.close()
    b.close()
