"""Shared fixtures: random-weight Qwen3 checkpoints generated offline, once per session."""

from __future__ import annotations

import pytest

from lmpool.model.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The default tiny preset (GQA 2, head_dim 64, tied embeddings, with a tokenizer)."""
    return str(make_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0))
