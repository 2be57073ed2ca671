"""Pool fixtures: every test must leave no LMPool process and no shared-memory object behind."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_leaks(no_leaks):
    yield
