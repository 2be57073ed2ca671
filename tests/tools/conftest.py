"""Tools fixtures: no pool process or shared memory outlives a test, and a private tmux
server to run ``lmpool top`` in a real terminal."""

from __future__ import annotations

import shutil

import pytest
from tools_testkit import Tmux


@pytest.fixture(autouse=True)
def no_leaks(no_leaks):
    yield


@pytest.fixture
def tmux(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    server = Tmux(tmp_path)
    yield server
    server.kill()
