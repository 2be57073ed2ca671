"""Shared fixtures: random-weight Qwen3 checkpoints generated offline, once per session, and
the leak check of the tests that start pools. The test process keys cuDNN's attention plans by
length bucket, as an engine does (``lmpool.ops.dense_attention.bucketed_plans``): torch reads
that once, at the process's first cuDNN attention, which a test of another path may make."""

from __future__ import annotations

import pytest
from leak_check import child_pids, describe, lmpool_shm

from lmpool.model.make_model import make_model
from lmpool.ops.dense_attention import bucketed_plans

bucketed_plans()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The default tiny preset (GQA 2, head_dim 64, tied embeddings, with a tokenizer)."""
    return str(make_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0))


@pytest.fixture
def no_leaks():
    """The test leaves no LMPool process and no shared-memory object behind (the pool
    tests make this autouse)."""
    shm_before, pids_before = lmpool_shm(), child_pids()
    yield
    assert child_pids() - pids_before == set(), "a pool process outlived its test"
    left = lmpool_shm() - shm_before
    assert left == set(), f"a pool left shared memory behind: {describe(left)}"
