"""The source revision a benchmark ran: ``LMPOOL_GIT_REVISION`` when set (a copy of the tree
on another machine may carry no git metadata, or stale metadata), else ``git rev-parse``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_revision() -> str | None:
    given = os.environ.get("LMPOOL_GIT_REVISION")
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None
