"""Pool fixtures: every test must leave no LMPool process and no shared-memory object behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def lmpool_shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "lmpool" in name}


def child_pids() -> set[int]:
    """Live processes whose command line runs an LMPool worker or control process."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(arg in (b"lmpool.pool.worker", b"lmpool.pool.control") for arg in cmdline):
            pids.add(int(entry.name))
    return pids


@pytest.fixture(autouse=True)
def no_leaks():
    shm_before, pids_before = lmpool_shm(), child_pids()
    yield
    assert child_pids() - pids_before == set(), "a pool process outlived its test"
    assert lmpool_shm() - shm_before == set(), "a pool left shared memory behind"
